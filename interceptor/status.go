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

// gRPC's own metadata names that the interceptors use.
const (
	// PushbackMetadata is the trailer that tells gRPC's retry policy how many
	// milliseconds to wait before the next attempt.
	PushbackMetadata = "grpc-retry-pushback-ms"
	// AttemptsMetadata is the header in which gRPC's retry policy counts the
	// earlier attempts of a call; the server interceptor reads the record of
	// a call with a count above 0 before it reserves.
	AttemptsMetadata = "grpc-previous-rpc-attempts"
)

// keyFromMetadata returns the idempotency key carried by md, as
// KeyFromIncomingContext does.
func keyFromMetadata(md metadata.MD) (key string, ok bool, err error) {
	return parseKey(md[idemkey.KeyMetadata], len(md[idemkey.KeyMetadata+"-bin"]) > 0)
}

// KeyFromIncomingContext returns the idempotency key of the call a server
// handles, read from its metadata without copying the rest of it. ok is
// false when the call carries none. A key that is malformed, sent more than
// once or sent as binary metadata gives an InvalidArgument error
// (idemkey.ReasonKeyInvalid) that never quotes the key.
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

// validateKey is idemkey.ValidateKey with its error as a gRPC status.
func validateKey(key string) error {
	if err := idemkey.ValidateKey(key); err != nil {
		return toError(rpckit.InvalidKey(err))
	}
	return nil
}

// missingKeyAdvice ends the message of the status for a call that must
// carry an idempotency key and does not. A call that grpc-gateway forwarded
// from an HTTP client is told of idemgateway, without which the gateway
// forwards no Idempotency-Key header: setting metadata means nothing to
// that client.
func missingKeyAdvice(ctx context.Context) string {
	if throughGateway(ctx) {
		return "this call came through grpc-gateway, which forwards the " + idemkey.KeyHeader +
			" header only from a ServeMux made with idemgateway.ServeMuxOptions (github.com/idemkey/idemkey/idemgateway)"
	}
	return "set the " + idemkey.KeyMetadata + " metadata to one random key per operation"
}

// gatewayPrefix starts the metadata keys under which grpc-gateway's header
// matchers forward the permanent HTTP headers (User-Agent, Accept,
// Content-Type, ...): grpc-gateway's runtime.MetadataPrefix, which this
// module does not import (grpc-gateway is idemgateway's alone).
const gatewayPrefix = "grpcgateway-"

// throughGateway reports whether the call came through grpc-gateway: its
// metadata holds a key that starts with gatewayPrefix, which no gRPC client
// sends of its own accord. Read only on a refusal, so the copy of the
// metadata costs a served call nothing.
func throughGateway(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	for k := range md {
		if strings.HasPrefix(k, gatewayPrefix) {
			return true
		}
	}
	return false
}

// firstSentInvalidError is the InvalidArgument status for a first-sent time
// (idemkey.FirstSentMetadata) that is malformed or sent more than once;
// problem says which and must not quote the value.
func firstSentInvalidError(problem string) error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first-sent time refused: "+problem))
}

// pushbackTrailer is the trailer that carries retryAfter to gRPC's retry
// policy, rounded up to whole milliseconds.
func pushbackTrailer(retryAfter time.Duration) metadata.MD {
	ms := retryAfter / time.Millisecond
	if retryAfter%time.Millisecond > 0 { // rounded up without overflow
		ms++
	}
	return metadata.Pairs(PushbackMetadata, strconv.FormatInt(int64(ms), 10))
}
