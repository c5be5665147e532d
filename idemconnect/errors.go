package idemconnect

import (
	"time"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// Header names as http.Header canonicalizes them: seconds to wait, gRPC's
// retry pushback in milliseconds, and its count of earlier attempts.
const (
	retryAfterHeader = "Retry-After"
	pushbackHeader   = "Grpc-Retry-Pushback-Ms"
	attemptsHeader   = "Grpc-Previous-Rpc-Attempts"
)

func checkKey(key string) *connect.Error {
	if err := idemkey.ValidateKey(key); err != nil {
		return toError(rpckit.InvalidKey(err))
	}
	return nil
}

// ceilDiv is d/unit rounded up, at least least, without overflow.
func ceilDiv(d, unit time.Duration, least int64) int64 {
	n := int64(d / unit)
	if d%unit > 0 {
		n++
	}
	return max(n, least)
}
