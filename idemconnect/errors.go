package idemconnect

import (
	"time"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// Header names beside idemkey.KeyHeader and idemkey.ReplayedHeader.
// http.Header canonicalizes them; gRPC clients see them in lower case.
const (
	// retryAfterHeader tells a client that finds its key in progress how
	// many seconds to wait.
	retryAfterHeader = "Retry-After"
	// pushbackHeader tells gRPC's retry policy how many milliseconds to wait
	// (grpc-retry-pushback-ms).
	pushbackHeader = "Grpc-Retry-Pushback-Ms"
	// attemptsHeader counts the earlier attempts of a call that gRPC's retry
	// policy sends again (grpc-previous-rpc-attempts).
	attemptsHeader = "Grpc-Previous-Rpc-Attempts"
)

// checkKey is idemkey.ValidateKey as a Connect error.
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
