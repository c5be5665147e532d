package interceptor

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// Option configures the server interceptor: the gRPC adapter's own
// settings. Those every entry point shares (tenant, key required, leases,
// retention, sealing, hooks, metrics, logging) are the engine's, set once
// with engine.New.
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

// FingerprintFunc hashes the parts of a request that make it "the same
// request". The default is protokey.HashRequest.
type FingerprintFunc func(fullMethod string, req proto.Message) (store.Fingerprint, error)

// options is shared by every call of one server interceptor; it is never
// modified after construction: the settings the Connect adapter has too,
// and this adapter's fingerprint and redaction.
type options = rpckit.Settings[FingerprintFunc, RedactFunc]

func newOptions(opts []Option) *options {
	o := rpckit.NewSettings[FingerprintFunc, RedactFunc]()
	for _, opt := range opts {
		opt.applyServer(o)
	}
	return o
}

// naming is how the errors of rpckit.Check name this adapter's options.
var naming = rpckit.Naming{Constructor: "UnaryServerInterceptor", Included: "WithIncludedMethods",
	Excluded: "WithExcludedMethods", Atomic: "WithAtomicMethods", Method: "method"}

// WithIncludedMethods covers the given methods ("/package.Service/Method")
// whatever their idempotency_level says.
func WithIncludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.Included = rpckit.Add(c.Included, fullMethods...) })
}

// WithExcludedMethods leaves the given methods uncovered: they pass through
// untouched. It wins over WithIncludedMethods.
func WithExcludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.Excluded = rpckit.Add(c.Excluded, fullMethods...) })
}

// WithFingerprint replaces Fingerprint, for example to leave out a field the
// client sets anew on every attempt, such as a timestamp. An error that is a
// gRPC status goes to the caller as it is; any other becomes Internal.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.Fingerprint = f })
}

// WithKeyField takes the idempotency key from the request field name too,
// as AIP-155 does with request_id, in every covered method whose request has
// a singular string field of that name. A request that sets the field and
// also carries the idempotency-key metadata with another key is refused
// with InvalidArgument (IDEMPOTENCY_KEY_INVALID); one that sets neither has
// no key. The default fingerprint leaves the field out, so that a request
// fingerprints alike whichever way its key came; a FingerprintFunc of your
// own should leave it out too (clear it on a proto.Clone of the request
// before protokey.HashRequest). The client interceptor sends no key of its
// own with a request that sets the field.
//
// Turning it on changes the fingerprint of requests that set the field, so
// records made before no longer match them: a retry that spans the change
// is refused as reused. Give it to servers and clients alike.
func WithKeyField(name string) MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.KeyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for the field AIP-155 describes: a
// request_id annotated (google.api.field_info).format = UUID4 (AIP-202), in
// every covered method whose request has one.
func WithAnnotatedKeyField() MethodOption {
	return methodOption(func(c *rpckit.Coverage) { c.KeyField = new(string) })
}

// WithRecordedCodes sets the error codes whose outcome is recorded and
// replayed; a handler error with any other code releases the key so that a
// retry runs the handler again. A success is always recorded. The default is
// NotFound, AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented,
// Internal, Unknown and DataLoss.
func WithRecordedCodes(cs ...codes.Code) Option {
	return serverOption(func(o *options) { o.Recorded = rpckit.CodeSet(cs...) })
}

// WithReplayedMetadata records the header and trailer metadata the handler
// sets under the given keys, binary ("-bin") keys included, and replays it
// with the outcome. By default no handler metadata is replayed. A replay sends
// only the keys listed now: a key taken off the list stops being replayed from
// records made while it was on it.
//
// A replay goes to every caller of the tenant who resends the key, so never
// list a header that belongs to one caller, such as a cookie or anything
// derived from the caller's credentials.
func WithReplayedMetadata(keys ...string) Option {
	return serverOption(func(o *options) { o.Replay(keys) })
}

// Reply is what is recorded of a call, and replayed to its retries, as a
// RedactFunc sees it and may change it.
type Reply struct {
	// Response is a copy of the handler's response, nil if it returned an
	// error. Change it in place, or replace it with a message of the same
	// type.
	Response proto.Message
	// Err is the handler's error, of a code that is recorded, nil if it
	// returned a response. Replace it to record another status (with
	// another message, or without details), or set it in place of a
	// response to record an error instead (say, FailedPrecondition
	// "credentials already issued"); an error cannot become a response.
	Err error
	// Header and Trailer are copies of the metadata the handler set under
	// the keys of WithReplayedMetadata (lower-case keys), nil if none.
	Header, Trailer metadata.MD
}

// RedactFunc removes from reply what must not be recorded: fields of the
// response (a card number, a vended credential), words of an error's
// message, metadata. fullMethod is the call's method ("/package.Service/Method").
type RedactFunc func(ctx context.Context, fullMethod string, reply *Reply)

// WithRedaction calls f on what is about to be recorded of each call whose
// reply is recorded, after the handler and before the store, so that what
// f removes is never stored. The first caller gets the handler's reply,
// whole; every retry with the key gets the redacted one, as recorded,
// whichever replica or transport serves it. So remove only what a retry can
// do without, and make the reply's clients expect it.
//
// f runs synchronously, on a copy: it may keep nothing of reply. A panic in
// f, or a reply it leaves that cannot be recorded (no response, a response
// of another type, an error turned into a response), records Internal in
// place of the reply, which the caller gets too, as every retry will: the
// handler has run, so its key is not released.
//
// Sealing (WithSealer) protects what is recorded; redaction decides what
// is: use both for a reply that carries secrets.
func WithRedaction(f RedactFunc) Option {
	return serverOption(func(o *options) { o.Redact = f })
}

// WithAtomic runs every covered method in atomic mode; WithAtomicMethods
// chooses some. The store must implement store.Atomic (store/postgres does).
//
// In atomic mode the reservation, the handler's own writes (through the
// transaction the store puts in the handler's context: see
// postgres.TxFromContext) and the recorded outcome commit in one transaction.
// Use it when all of a handler's effects are writes to the store's database;
// keep the default two-phase mode when the handler calls other systems. What
// changes:
//   - A success commits with its writes. A recorded error undoes the
//     handler's writes but commits the record. A released error, or a panic,
//     rolls everything back and leaves the key free. The store's
//     documentation says what else a handler must know (postgres: a
//     serialization failure is best answered with a released code).
//   - A crash, or a connection lost at any point, rolls everything back: the
//     key is never left in progress, and a retry runs the handler once more.
//     So the first caller gets the handler's reply only once it has
//     committed; if the commit fails, it gets Unavailable instead, and its
//     retry finds the truth (the replay, or a fresh run).
//   - A duplicate of a running call is told so by the store at once (the
//     first call's record is written only when it commits), and asks again
//     while WithInProgressWait lasts, and then gets Aborted with the
//     pushback of WithMaxRetryAfter; if the first call commits meanwhile,
//     the duplicate gets the replay, and if it rolls back, the duplicate
//     runs. Until the first call commits, its fingerprint cannot be read, so
//     a duplicate with a different request also gets Aborted, and
//     InvalidArgument (reused) only once the first has committed. Asking
//     takes none of the capacity that new keys need (postgres: no
//     transaction slot, no wait on a lock).
//   - A store failure always fails closed, even with WithFailOpen: the
//     handler's writes need the same database.
//   - A call without a key (WithKeyRequired not set) runs the handler with no
//     transaction in its context, as in two-phase mode: a handler that allows
//     that falls back to its pool when postgres.TxFromContext reports none.
//   - Each running call holds one of the store's connections until it ends;
//     the store bounds how many (postgres.WithAtomicConns), so that
//     replays and reservations still find one.
func WithAtomic() Option {
	return serverOption(func(o *options) { o.AtomicAll = true })
}

// WithAtomicMethods runs the given methods ("/package.Service/Method") in
// atomic mode; see WithAtomic.
func WithAtomicMethods(fullMethods ...string) Option {
	return serverOption(func(o *options) { o.Atomic = rpckit.Add(o.Atomic, fullMethods...) })
}
