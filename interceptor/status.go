package interceptor

import (
	"context"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// gRPC's own metadata names: the retry policy's pushback trailer, and its
// count of a call's earlier attempts (the server reads a later attempt's
// record before it reserves).
const (
	PushbackMetadata = "grpc-retry-pushback-ms"
	AttemptsMetadata = "grpc-previous-rpc-attempts"
)

func keyFromMetadata(md metadata.MD) (key string, ok bool, err error) {
	return parseKey(md[idemkey.KeyMetadata], len(md[idemkey.KeyMetadata+"-bin"]) > 0)
}

// KeyFromIncomingContext returns the key of the call a server handles; ok is
// false if none. A malformed key gives InvalidArgument, which never quotes it.
func KeyFromIncomingContext(ctx context.Context) (key string, ok bool, err error) {
	return parseKey(metadata.ValueFromIncomingContext(ctx, idemkey.KeyMetadata),
		len(metadata.ValueFromIncomingContext(ctx, idemkey.KeyMetadata+"-bin")) > 0)
}

func parseKey(values []string, binary bool) (string, bool, error) {
	key, ok, err := rpckit.TransportKey(values, binary)
	if err != nil {
		return "", false, toError(rpckit.InvalidKey(err))
	}
	return key, ok, nil
}

func validateKey(key string) error {
	if err := idemkey.ValidateKey(key); err != nil {
		return toError(rpckit.InvalidKey(err))
	}
	return nil
}

// missingKeyAdvice tells a call through grpc-gateway of idemgateway, without
// which the gateway forwards no Idempotency-Key header.
func missingKeyAdvice(ctx context.Context) string {
	if throughGateway(ctx) {
		return "this call came through grpc-gateway, which forwards the " + idemkey.KeyHeader +
			" header only from a ServeMux made with idemgateway.ServeMuxOptions (github.com/idemkey/idemkey/idemgateway)"
	}
	return "set the " + idemkey.KeyMetadata + " metadata to one random key per operation"
}

// gatewayPrefix is grpc-gateway's runtime.MetadataPrefix, not imported: it
// is idemgateway's dependency alone.
const gatewayPrefix = "grpcgateway-"

// throughGateway is read only on a refusal, so its copy of the metadata costs
// a served call nothing.
func throughGateway(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	for k := range md {
		if strings.HasPrefix(k, gatewayPrefix) {
			return true
		}
	}
	return false
}

// firstSentInvalidError refuses a malformed or repeated first-sent time;
// problem must not quote the value.
func firstSentInvalidError(problem string) error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first-sent time refused: "+problem))
}

// firstRegionInvalidError refuses a malformed or repeated first region,
// with the first-sent time's reason; problem must not quote the value.
func firstRegionInvalidError(problem string) error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first region refused: "+problem))
}

func pushbackTrailer(retryAfter time.Duration) metadata.MD {
	ms := retryAfter / time.Millisecond
	if retryAfter%time.Millisecond > 0 { // rounded up without overflow
		ms++
	}
	return metadata.Pairs(PushbackMetadata, strconv.FormatInt(int64(ms), 10))
}
