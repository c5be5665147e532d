package interceptor

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Defaults, each changed by the option that names it.
const (
	DefaultLease         = engine.DefaultLease         // WithLease, for calls without a deadline
	DefaultMaxLease      = engine.DefaultMaxLease      // WithMaxLease
	DefaultRetention     = engine.DefaultRetention     // WithRetention
	DefaultMaxRetryAfter = engine.DefaultMaxRetryAfter // WithMaxRetryAfter
	DefaultClockSkew     = engine.DefaultClockSkew     // WithClockSkew

	DefaultInProgressWait = engine.DefaultInProgressWait // WithInProgressWait

	DefaultMaxRecordSize = engine.DefaultMaxRecordSize // WithMaxRecordSize, in bytes
)

// Option configures the server interceptor. Every Option is the server's
// own, or one of the settings every entry point shares (tenant, key
// required, lease, retention, fail-open, record size, logger, metrics), under
// the name it has in every entry point's package.
type Option interface{ applyServer(*options) }

// ClientOption configures the client interceptor.
type ClientOption interface{ applyClient(*coverage) }

// MethodOption configures both interceptors: which methods are covered, and
// where a request carries its key.
type MethodOption interface {
	Option
	ClientOption
}

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type methodOption func(*coverage)

func (f methodOption) applyServer(o *options)  { f(&o.coverage) }
func (f methodOption) applyClient(c *coverage) { f(c) }

// TenantFunc returns the authenticated tenant of a call, for example from the
// identity an authentication interceptor put in ctx. An error is returned to
// the caller unchanged, so it should be a status error such as Unauthenticated.
type TenantFunc = engine.TenantFunc

// FingerprintFunc hashes the parts of a request that make it "the same
// request". The default is protokey.HashRequest.
type FingerprintFunc func(fullMethod string, req proto.Message) (store.Fingerprint, error)

// Scope is the set of calls within which one idempotency key names one
// operation.
type Scope = engine.Scope

const (
	// ScopeTenantOperation: a key is scoped to its tenant and method, so the
	// same key on two methods names two operations. The default.
	ScopeTenantOperation = engine.ScopeTenantOperation
	// ScopeTenant: a key is scoped to its tenant only; using it on a second
	// method is refused as a reused key. For internal APIs whose clients share
	// one key across methods.
	ScopeTenant = engine.ScopeTenant
)

// coverage is what both interceptors read: the methods forced in or out,
// and the request field that carries the key.
type coverage struct {
	included map[string]bool
	excluded map[string]bool
	keyField *string // WithKeyField, WithAnnotatedKeyField; nil: none
}

// options is shared by every call of one server interceptor; it is never
// modified after construction.
type options struct {
	coverage
	engine      []engine.Option // the settings the engine reads
	fingerprint FingerprintFunc // nil: protokey's, without the key field
	recorded    map[codes.Code]bool
	replayed    map[string]bool // metadata keys replayed from the record
	atomicAll   bool
	atomic      map[string]bool
	redact      RedactFunc
}

// defaultRecorded are the error codes whose outcome is final: a retry would
// get the same answer, so it gets the recorded one. Every other code releases
// the key.
var defaultRecorded = []codes.Code{
	codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.OutOfRange,
	codes.Unimplemented, codes.Internal, codes.Unknown, codes.DataLoss,
}

func newOptions(opts []Option) *options {
	o := &options{recorded: codeSet(defaultRecorded)}
	for _, opt := range opts {
		opt.applyServer(o)
	}
	return o
}

func newClientOptions(opts []ClientOption) *options {
	o := &options{}
	for _, opt := range opts {
		opt.applyClient(&o.coverage)
	}
	return o
}

// withEngine is an Option that sets engine options.
func withEngine(opts ...engine.Option) Option {
	return serverOption(func(o *options) { o.engine = append(o.engine, opts...) })
}

// WithTenant scopes keys to the tenant f returns. Without it every caller
// shares one key space, which is right only for single-tenant services.
func WithTenant(f TenantFunc) Option {
	return withEngine(engine.WithTenant(f))
}

// WithKeyRequired refuses calls to covered methods that carry no key, with
// InvalidArgument and reason IDEMPOTENCY_KEY_MISSING. By default such calls
// run without protection.
func WithKeyRequired() Option {
	return withEngine(engine.WithKeyRequired())
}

// WithIncludedMethods covers the given methods ("/package.Service/Method")
// whatever their idempotency_level says.
func WithIncludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *coverage) { c.included = addAll(c.included, fullMethods...) })
}

// WithExcludedMethods leaves the given methods uncovered: they pass through
// untouched. It wins over WithIncludedMethods.
func WithExcludedMethods(fullMethods ...string) MethodOption {
	return methodOption(func(c *coverage) { c.excluded = addAll(c.excluded, fullMethods...) })
}

// WithScope sets the scope of a key; the default is ScopeTenantOperation.
func WithScope(s Scope) Option {
	return withEngine(engine.WithScope(s))
}

// WithFingerprint replaces Fingerprint, for example to leave out a field the
// client sets anew on every attempt, such as a timestamp. An error that is a
// gRPC status goes to the caller as it is; any other becomes Internal.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.fingerprint = f })
}

// WithKeyField takes the idempotency key from the request field name too,
// as AIP-155 does with request_id, in every covered method whose request has
// a singular string field of that name. A request that sets the field and
// also carries the idempotency-key metadata with another key is refused
// with InvalidArgument (IDEMPOTENCY_KEY_INVALID); one that sets neither has
// no key. The default fingerprint leaves the field out, so that a request
// fingerprints alike whichever way its key came; a FingerprintFunc of your
// own should leave it out too. The client interceptor sends no key of its
// own with a request that sets the field.
//
// Turning it on changes the fingerprint of requests that set the field, so
// records made before no longer match them: a retry that spans the change
// is refused as reused. Give it to servers and clients alike.
func WithKeyField(name string) MethodOption {
	return methodOption(func(c *coverage) { c.keyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for the field AIP-155 describes: a
// request_id annotated (google.api.field_info).format = UUID4 (AIP-202), in
// every covered method whose request has one.
func WithAnnotatedKeyField() MethodOption {
	return methodOption(func(c *coverage) { c.keyField = new(string) })
}

// WithRecordedCodes sets the error codes whose outcome is recorded and
// replayed; a handler error with any other code releases the key so that a
// retry runs the handler again. A success is always recorded. The default is
// NotFound, AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented,
// Internal, Unknown and DataLoss.
func WithRecordedCodes(cs ...codes.Code) Option {
	return serverOption(func(o *options) { o.recorded = codeSet(cs) })
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
	return serverOption(func(o *options) {
		for _, k := range keys {
			o.replayed = addAll(o.replayed, strings.ToLower(k))
		}
	})
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
	return serverOption(func(o *options) { o.redact = f })
}

// WithLease sets how long a running call without a deadline holds its key
// before a retry may presume it dead and run the handler again
// (DefaultLease). A call with a deadline holds it for its remaining time plus
// a grace period. Either way the lease is at most WithMaxLease. A value of
// zero or less keeps the default.
func WithLease(d time.Duration) Option {
	return withEngine(engine.WithLease(d))
}

// WithMaxLease bounds every lease (DefaultMaxLease). A value of zero or less
// keeps the default.
func WithMaxLease(d time.Duration) Option {
	return withEngine(engine.WithMaxLease(d))
}

// WithRetention sets how long an outcome is kept and replayed, counted from
// the first call. After it the key is new again. A value of zero or less keeps
// the default.
func WithRetention(d time.Duration) Option {
	return withEngine(engine.WithRetention(d))
}

// WithClockSkew sets how far a client's clock may be from the store's
// (DefaultClockSkew), for calls that carry idemkey.FirstSentMetadata. A call
// first sent longer ago than the retention less the skew, whose key has no
// record, is refused with FailedPrecondition (IDEMPOTENCY_KEY_EXPIRED)
// without running: its record may have existed and expired. One first sent
// later than the skew from now is refused with InvalidArgument
// (IDEMPOTENCY_FIRST_SENT_INVALID). See engine.WithClockSkew.
func WithClockSkew(d time.Duration) Option {
	return withEngine(engine.WithClockSkew(d))
}

// WithMaxRetryAfter sets the longest wait the server asks of a retry that
// finds its key in progress (the pushback trailer and RetryInfo). The wait is
// never longer than the lease has left, nor shorter than a millisecond.
func WithMaxRetryAfter(d time.Duration) Option {
	return withEngine(engine.WithMaxRetryAfter(d))
}

// WithInProgressWait sets how long a duplicate that finds its key in progress
// waits at the server for the first call to end, before it is answered
// Aborted with a pushback (DefaultInProgressWait, 2s; 0 answers at once). The
// wait ends early with the first call's recorded reply, or, if the first call
// released its key, with a run of the handler; it never outlasts the
// duplicate's own deadline. Meanwhile the store is polled with a growing
// interval (25ms, doubling to 500ms): for the default, at most 9 reads. With
// the shipped service config's 5 attempts and 1s pushbacks, a duplicate thus
// covers about 14s, enough for a first call that runs 10s. In atomic mode the
// polls are reads (store.Finder), so a waiting duplicate holds no connection.
func WithInProgressWait(d time.Duration) Option {
	return withEngine(engine.WithInProgressWait(d))
}

// WithMaxRecordSize bounds the record of one outcome: the encoded response
// or status with its replayed metadata (DefaultMaxRecordSize, 4 MiB, if
// n < 1; never below engine.MinRecordSize, 1 KiB). A reply whose record
// would be larger is not kept: the key records Internal instead ("too large
// to record"), and the caller gets that Internal
// too, as every retry will, so that no two callers see different replies. The
// handler has run, so its key is not released: in two-phase mode its effects
// stand; in atomic mode its writes roll back with the recorded error. The
// memory store sets this much room aside for each call while it runs, so
// that every call it lets run can record its reply: a bound near the
// largest real reply lets more calls run at once.
func WithMaxRecordSize(n int) Option {
	return withEngine(engine.WithMaxRecordSize(n))
}

// Sealer encrypts recorded outcomes at rest: a *seal.KeyRing.
type Sealer = engine.Sealer

// WithSealer seals every recorded outcome with s before it reaches the
// store, and opens it for each replay (see package seal: AES-256-GCM bound
// to the record's key, a key ring that rotates). A record that does not open
// (a key s lacks, altered, copied from another key's record) is neither
// replayed nor run again: the call gets Unavailable
// (IDEMPOTENCY_STORE_UNAVAILABLE), even with WithFailOpen, and the reason is
// logged at Error. Give every entry point that shares the store the same
// key ring.
func WithSealer(s Sealer) Option {
	return withEngine(engine.WithSealer(s))
}

// WithFailOpen runs the handler without protection when the store fails,
// instead of answering Unavailable. Retries may then run the handler twice.
// Methods in atomic mode fail closed all the same, and a full store
// (store.ErrFull) refuses new keys with ResourceExhausted: a bound is not a
// failure.
func WithFailOpen() Option {
	return withEngine(engine.WithFailOpen())
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
	return serverOption(func(o *options) { o.atomicAll = true })
}

// WithAtomicMethods runs the given methods ("/package.Service/Method") in
// atomic mode; see WithAtomic.
func WithAtomicMethods(fullMethods ...string) Option {
	return serverOption(func(o *options) { o.atomic = addAll(o.atomic, fullMethods...) })
}

// WithLogger sets the logger for store failures and lost leases; the default
// is slog.Default(), and nil discards the records. idemkey's own log records
// never hold a raw key, tenant or request; an error from a FingerprintFunc is
// logged as it is.
func WithLogger(l *slog.Logger) Option {
	return withEngine(engine.WithLogger(l))
}

// Hooks are the application's callbacks on how each call ended; see
// engine.Hooks and WithHooks.
type Hooks = engine.Hooks

// WithHooks calls the application's hooks once for each call to a covered
// method: OnExecute when the handler ran, OnReplay when a retry got the
// recorded reply, OnRefuse when the call was answered without either (in
// progress, reused or missing or malformed key, store full or
// unavailable, a refused tenant). Each gets an engine.Event with the
// method, the tenant, the key, the verdict, the gRPC code answered
// (Event.Code, a codes.Code) and the record's size in bytes. A hook runs on
// the call's goroutine before the interceptor returns its answer, so that
// its time adds to the call's; its context has the call's values but not
// its cancellation; a panic in it is logged and changes neither the answer
// nor the record. See engine.WithHooks for the whole contract.
func WithHooks(h Hooks) Option {
	return withEngine(engine.WithHooks(h))
}

// WithMeterProvider sets where the server interceptor's metrics go; the
// default is otel.GetMeterProvider(), which does nothing until an SDK is
// installed. See the package documentation for the metrics.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return withEngine(engine.WithMeterProvider(mp))
}

// WithTracerProvider sets the tracer of the spans the server interceptor
// opens for its store operations, as children of the call's span and only
// when that one is recording; the default is otel.GetTracerProvider().
// idemkey opens no span for the call itself: it adds its outcome to the
// call's span (otelgrpc's, for instance).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return withEngine(engine.WithTracerProvider(tp))
}

func codeSet(cs []codes.Code) map[codes.Code]bool {
	set := make(map[codes.Code]bool, len(cs))
	for _, c := range cs {
		set[c] = true
	}
	return set
}

func addAll(set map[string]bool, items ...string) map[string]bool {
	if set == nil {
		set = make(map[string]bool, len(items))
	}
	for _, it := range items {
		set[it] = true
	}
	return set
}
