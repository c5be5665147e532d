package interceptor

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// Option configures the server interceptor. Settings every entry point
// shares are the engine's (engine.New).
type Option interface{ applyServer(*options) }

// MethodOption configures both interceptors: which methods are covered, and
// where a request carries its key. The client interceptor takes only these.
type MethodOption interface {
	Option
	applyClient(*rpckit.Coverage)
}

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type methodOption func(*rpckit.Coverage)

func (f methodOption) applyServer(o *options)         { f(&o.Coverage) }
func (f methodOption) applyClient(c *rpckit.Coverage) { f(c) }

// FingerprintFunc hashes what makes a request "the same request".
type FingerprintFunc func(fullMethod string, req proto.Message) (store.Fingerprint, error)

// options is never modified after construction.
type options = rpckit.Settings[FingerprintFunc, RedactFunc]

func newOptions(opts []Option) *options {
	o := rpckit.NewSettings[FingerprintFunc, RedactFunc]()
	for _, opt := range opts {
		opt.applyServer(o)
	}
	return o
}

var naming = rpckit.Naming{Constructor: "UnaryServerInterceptor", Included: "WithIncludedMethods",
	Excluded: "WithExcludedMethods", Atomic: "WithAtomicMethods", Retention: "WithMethodRetention", Method: "method"}

// WithIncludedMethods covers the given methods ("/package.Service/Method")
// whatever their idempotency_level says.
func WithIncludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.Included = rpckit.Add(c.Included, fullMethods...) })
}

// WithExcludedMethods leaves methods uncovered, over WithIncludedMethods.
func WithExcludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.Excluded = rpckit.Add(c.Excluded, fullMethods...) })
}

// WithFingerprint replaces protokey.HashRequest. An error that is a gRPC
// status goes to the caller as it is; any other becomes Internal.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.Fingerprint = f })
}

// WithKeyField takes the key from the request's string field name too (AIP-155
// request_id), left out of the default fingerprint. Give it to servers and
// clients alike: a retry that spans the change is refused as reused.
func WithKeyField(name string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.KeyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for a request_id annotated
// (google.api.field_info).format = UUID4 (AIP-202).
func WithAnnotatedKeyField() MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.KeyField = new(string) })
}

// WithRecordedCodes sets the error codes whose outcome is recorded and
// replayed; any other code releases the key. A success is always recorded.
// The default is NotFound, AlreadyExists, FailedPrecondition, OutOfRange,
// Unimplemented, Internal, Unknown and DataLoss.
func WithRecordedCodes(cs ...codes.Code) Option {
	return serverOption(func(o *options) { o.Recorded = rpckit.CodeSet(cs...) })
}

// WithReplayedMetadata records and replays the handler's metadata of the
// given keys. Every caller of the tenant who resends the key gets it, so
// never list a header of one caller's, such as a cookie.
func WithReplayedMetadata(keys ...string) Option {
	return serverOption(func(o *options) { o.Replay(keys) })
}

// Reply is what is recorded of a call, as a RedactFunc sees and may change
// it: copies of the response (nil on error; replace it only with the same
// type), the error (replace it, or set it in place of a response; an error
// cannot become a response), and the WithReplayedMetadata metadata.
type Reply struct {
	Response        proto.Message
	Err             error
	Header, Trailer metadata.MD
}

// WithMethodRetention keeps the records of the given covered methods
// ("/package.Service/Method") for d, in place of the engine's retention
// (engine.WithRetention): their keys' expiry, the refusal of a retry first
// sent longer ago, and the sweep follow it. UnaryServerInterceptor refuses
// a d shorter than the engine's longest lease (engine.WithMaxLease).
func WithMethodRetention(d time.Duration, fullMethods ...string) Option {
	return serverOption(func(o *options) { o.Retention = rpckit.AddRetention(o.Retention, d, fullMethods...) })
}

// RedactFunc removes from reply what must not be recorded.
type RedactFunc func(ctx context.Context, fullMethod string, reply *Reply)

// WithRedaction calls f on a copy of each reply before it is recorded: the
// first caller gets the whole reply, every retry the redacted one. A panic in
// f, or a reply it leaves unrecordable, records Internal.
func WithRedaction(f RedactFunc) Option {
	return serverOption(func(o *options) { o.Redact = f })
}

// WithAtomic runs every covered method in atomic mode: the reservation, the
// handler's writes (through postgres.TxFromContext) and the record commit in
// one transaction, on a store.Atomic. A store failure fails closed even with
// WithFailOpen; docs/grpc.md, "Two modes", has the rest.
func WithAtomic() Option {
	return serverOption(func(o *options) { o.AtomicAll = true })
}

// WithAtomicMethods runs the given methods ("/package.Service/Method") in
// atomic mode; see WithAtomic.
func WithAtomicMethods(fullMethods ...string) Option {
	return serverOption(func(o *options) { o.Atomic = rpckit.Add(o.Atomic, fullMethods...) })
}
