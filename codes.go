package idemkey

import (
	"context"
	"errors"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkey/idemkey/engine"
)

// Metadata names. gRPC metadata keys are lower case.
const (
	// KeyMetadata carries the idempotency key from client to server.
	KeyMetadata = "idempotency-key"
	// ReplayedMetadata is the trailer set to "true" on a replayed reply.
	ReplayedMetadata = "idempotent-replayed"
	// PushbackMetadata is the trailer that tells gRPC's retry policy how many
	// milliseconds to wait before the next attempt.
	PushbackMetadata = "grpc-retry-pushback-ms"
	// AttemptsMetadata is the header in which gRPC's retry policy counts the
	// earlier attempts of a call; the server interceptor reads the record of
	// a call with a count above 0 before it reserves.
	AttemptsMetadata = "grpc-previous-rpc-attempts"
)

// MaxKeyLen is the longest idempotency key accepted, in bytes.
const MaxKeyLen = engine.MaxKeyLen

// ErrorDomain is the domain of the google.rpc.ErrorInfo on every idemkey error.
const ErrorDomain = "idemkey.dev"

// Reasons in the google.rpc.ErrorInfo of idemkey errors; Reason reads them back.
const (
	ReasonKeyMissing       = engine.ReasonKeyMissing       // InvalidArgument (HTTP 400)
	ReasonKeyInvalid       = engine.ReasonKeyInvalid       // InvalidArgument (HTTP 400)
	ReasonKeyReused        = engine.ReasonKeyReused        // InvalidArgument (HTTP 422)
	ReasonInProgress       = engine.ReasonInProgress       // Aborted (HTTP 409)
	ReasonStoreUnavailable = engine.ReasonStoreUnavailable // Unavailable (HTTP 503)
	ReasonStoreFull        = engine.ReasonStoreFull        // ResourceExhausted (HTTP 503)
)

// KeyFromMetadata returns the idempotency key carried by md. ok is false when
// md carries none. A key that is malformed, sent more than once or sent as
// binary metadata gives an InvalidKeyError; the error never quotes the key.
func KeyFromMetadata(md metadata.MD) (key string, ok bool, err error) {
	return parseKey(md[KeyMetadata], len(md[KeyMetadata+"-bin"]) > 0)
}

// KeyFromIncomingContext is KeyFromMetadata for the metadata of the call a
// server handles, without copying the rest of it.
func KeyFromIncomingContext(ctx context.Context) (key string, ok bool, err error) {
	return parseKey(metadata.ValueFromIncomingContext(ctx, KeyMetadata),
		len(metadata.ValueFromIncomingContext(ctx, KeyMetadata+"-bin")) > 0)
}

func parseKey(values []string, binary bool) (string, bool, error) {
	if binary {
		return "", false, InvalidKeyError("it was sent as binary metadata")
	}
	switch len(values) {
	case 0:
		return "", false, nil
	case 1:
		if err := ValidateKey(values[0]); err != nil {
			return "", false, err
		}
		return values[0], true, nil
	default:
		return "", false, InvalidKeyError("it was sent more than once")
	}
}

// ValidateKey returns an InvalidKeyError unless key is 1 to MaxKeyLen bytes of
// visible ASCII (0x21 to 0x7E). A UUID, a ULID or base64url text all qualify.
func ValidateKey(key string) error {
	if err := engine.CheckKey(key); err != nil {
		return InvalidKeyError(err.(*engine.KeyError).Problem)
	}
	return nil
}

// MissingKeyError is the InvalidArgument status for a call that must carry an
// idempotency key and does not.
func MissingKeyError() error {
	return newError(codes.InvalidArgument, ReasonKeyMissing,
		"idempotency key required: set the "+KeyMetadata+" metadata to one random key per operation")
}

// InvalidKeyError is the InvalidArgument status for a malformed key; problem
// says what is wrong with it and must not quote the key.
func InvalidKeyError(problem string) error {
	return newError(codes.InvalidArgument, ReasonKeyInvalid, "idempotency key malformed: "+problem)
}

// ReusedKeyError is the InvalidArgument status for a key that was first used
// with a different request.
func ReusedKeyError() error {
	return newError(codes.InvalidArgument, ReasonKeyReused,
		"idempotency key already used with a different request")
}

// InProgressError is the Aborted status for a retry that arrives while the
// first call with its key is still running. It carries a google.rpc.RetryInfo
// with retryAfter; the server also sends it as the PushbackMetadata trailer.
func InProgressError(retryAfter time.Duration) error {
	return newError(codes.Aborted, ReasonInProgress,
		"a call with this idempotency key is in progress; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
}

// StoreUnavailableError is the Unavailable status for a call whose key could
// not be checked because the store failed; the handler did not run.
func StoreUnavailableError() error {
	return newError(codes.Unavailable, ReasonStoreUnavailable,
		"idempotency store unavailable; the call was not run")
}

// StoreFullError is the ResourceExhausted status for a new key that the store
// has no room to reserve (store.ErrFull); the handler did not run, and
// replays of recorded keys still work. It carries a google.rpc.RetryInfo with
// retryAfter, the time until the store expects room.
func StoreFullError(retryAfter time.Duration) error {
	return newError(codes.ResourceExhausted, ReasonStoreFull,
		"idempotency store full; the call was not run; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
}

// PushbackTrailer is the trailer that carries retryAfter to gRPC's retry
// policy, rounded up to whole milliseconds.
func PushbackTrailer(retryAfter time.Duration) metadata.MD {
	ms := retryAfter / time.Millisecond
	if retryAfter%time.Millisecond > 0 { // rounded up without overflow
		ms++
	}
	return metadata.Pairs(PushbackMetadata, strconv.FormatInt(int64(ms), 10))
}

// Reason returns the idemkey reason (one of the Reason constants) carried by
// err, or "" when err is not an idemkey error.
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

// Replayed reports whether trailer marks a reply replayed from the record of
// an earlier call rather than produced by running the handler.
func Replayed(trailer metadata.MD) bool {
	v := trailer.Get(ReplayedMetadata)
	return len(v) == 1 && v[0] == "true"
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
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == ErrorDomain {
			return info
		}
	}
	return nil
}

func newError(code codes.Code, reason, msg string, extra ...protoadapt.MessageV1) error {
	st := status.New(code, msg)
	details := append([]protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}}, extra...)
	withDetails, err := st.WithDetails(details...)
	if err != nil {
		// Only a detail that cannot be marshalled fails here, and ours can.
		return st.Err()
	}
	return withDetails.Err()
}

// NewKey returns a fresh random key: a version 4 UUID from crypto/rand. Keep it
// with the business operation it names, so that a restarted process retries
// with the same key.
func NewKey() string { return engine.NewKey() }

// DeriveKey returns the key for a call that one operation makes to another
// idempotent API (a payment provider, another gRPC service): a version 8 UUID
// from the SHA-256 of the operation's tenant, full method and key, and label,
// which names the downstream call. Every retry of the operation derives the
// same key, so the downstream API deduplicates too; any other tenant, method,
// key or label derives another. In a handler, interceptor.DerivedKey fills in
// the call's own parts.
func DeriveKey(tenant, fullMethod, key, label string) string {
	return engine.DeriveKey(tenant, fullMethod, key, label)
}
