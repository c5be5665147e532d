package interceptor

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
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
	if binary {
		return "", false, invalidKeyError("it was sent as binary metadata")
	}
	switch len(values) {
	case 0:
		return "", false, nil
	case 1:
		key, err := idemkey.ParseKey(values[0])
		if err != nil {
			return "", false, invalidKeyError(err.(*idemkey.KeyError).Problem)
		}
		return key, true, nil
	default:
		return "", false, invalidKeyError("it was sent more than once")
	}
}

// validateKey is idemkey.ValidateKey with its error as an invalidKeyError.
func validateKey(key string) error {
	if err := idemkey.ValidateKey(key); err != nil {
		return invalidKeyError(err.(*idemkey.KeyError).Problem)
	}
	return nil
}

// missingKeyError is the InvalidArgument status for a call that must carry an
// idempotency key and does not. A call that grpc-gateway forwarded from an
// HTTP client is told of idemgateway, without which the gateway forwards
// no Idempotency-Key header: setting metadata means nothing to that client.
func missingKeyError(ctx context.Context) error {
	if throughGateway(ctx) {
		return newError(codes.InvalidArgument, idemkey.ReasonKeyMissing,
			"idempotency key required: this call came through grpc-gateway, which forwards the "+idemkey.KeyHeader+
				" header only from a ServeMux made with idemgateway.ServeMuxOptions (github.com/idemkey/idemkey/idemgateway)")
	}
	return newError(codes.InvalidArgument, idemkey.ReasonKeyMissing,
		"idempotency key required: set the "+idemkey.KeyMetadata+" metadata to one random key per operation")
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

// invalidKeyError is the InvalidArgument status for a malformed key; problem
// says what is wrong with it and must not quote the key.
func invalidKeyError(problem string) error {
	return newError(codes.InvalidArgument, idemkey.ReasonKeyInvalid, "idempotency key malformed: "+problem)
}

// reusedKeyError is the InvalidArgument status for a key that was first used
// with a different request.
func reusedKeyError() error {
	return newError(codes.InvalidArgument, idemkey.ReasonKeyReused,
		"idempotency key already used with a different request")
}

// inProgressError is the Aborted status for a retry that arrives while the
// first call with its key is still running. It carries a google.rpc.RetryInfo
// with retryAfter; the server also sends it as the PushbackMetadata trailer.
func inProgressError(retryAfter time.Duration) error {
	return newError(codes.Aborted, idemkey.ReasonInProgress,
		"a call with this idempotency key is in progress; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
}

// keyExpiredError is the FailedPrecondition status for a call whose key's
// operation was first sent (idemkey.FirstSentMetadata) longer ago than keys
// are kept, and whose key has no record: its first call may have run and
// its record expired, so it is not run again.
func keyExpiredError() error {
	return newError(codes.FailedPrecondition, idemkey.ReasonKeyExpired,
		"idempotency key expired: its operation was first sent longer ago than keys are kept, and it has no record; the call was not run")
}

// firstSentInvalidError is the InvalidArgument status for a first-sent time
// (idemkey.FirstSentMetadata) that is malformed, sent more than once, or in
// the future; problem says which and must not quote the value.
func firstSentInvalidError(problem string) error {
	return newError(codes.InvalidArgument, idemkey.ReasonFirstSentInvalid,
		"idempotency first-sent time refused: "+problem)
}

// firstSentError is the engine's *engine.FirstSentError as a firstSentInvalidError.
func firstSentError(err error) error {
	var fse *engine.FirstSentError
	if errors.As(err, &fse) {
		return firstSentInvalidError(fse.Problem)
	}
	return firstSentInvalidError("it cannot be read")
}

// storeUnavailableError is the Unavailable status for a call whose key could
// not be checked because the store failed; the handler did not run.
func storeUnavailableError() error {
	return newError(codes.Unavailable, idemkey.ReasonStoreUnavailable,
		"idempotency store unavailable; the call was not run")
}

// storeFullError is the ResourceExhausted status for a new key that the store
// has no room to reserve (store.ErrFull); the handler did not run, and
// replays of recorded keys still work. It carries a google.rpc.RetryInfo with
// retryAfter, the time until the store expects room.
func storeFullError(retryAfter time.Duration) error {
	return newError(codes.ResourceExhausted, idemkey.ReasonStoreFull,
		"idempotency store full; the call was not run; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
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

// Reason returns the idemkey reason (one of idemkey's Reason constants)
// carried by the gRPC error err, or "" when err is not an idemkey error.
func Reason(err error) string {
	if info := errorInfo(err); info != nil {
		return info.GetReason()
	}
	return ""
}

// RetryDelay returns the delay an in-progress error asks the client to wait.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

func errorInfo(err error) *errdetails.ErrorInfo {
	if err == nil {
		return nil
	}
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		return nil
	}
	for _, d := range se.GRPCStatus().Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == idemkey.ErrorDomain {
			return info
		}
	}
	return nil
}

func newError(code codes.Code, reason, msg string, extra ...protoadapt.MessageV1) error {
	st := status.New(code, msg)
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: idemkey.ErrorDomain}}, extra...)
	withDetails, err := st.WithDetails(details...)
	if err != nil {
		// Only a detail that cannot be marshalled fails here, and ours can.
		return st.Err()
	}
	return withDetails.Err()
}
