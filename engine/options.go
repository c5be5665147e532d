package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Defaults, each changed by the option that names it.
const (
	DefaultLease          = time.Minute      // WithLease, for calls without a deadline
	DefaultMaxLease       = 10 * time.Minute // WithMaxLease
	DefaultRetention      = 24 * time.Hour   // WithRetention
	DefaultMaxRetryAfter  = time.Second      // WithMaxRetryAfter
	DefaultInProgressWait = 2 * time.Second  // WithInProgressWait
	DefaultMaxRecordSize  = 4 << 20          // WithMaxRecordSize, in bytes
	DefaultClockSkew      = 5 * time.Minute  // WithClockSkew
)

// leaseGrace is added to a call's remaining deadline to give its lease: the
// handler may notice the deadline late, and the record is written after it.
const leaseGrace = 5 * time.Second

// Option configures an Engine.
type Option func(*options)

// TenantFunc returns the authenticated tenant of a call, for example from the
// identity an authentication layer put in ctx. Its error is the Answer.Err of
// a refusal with Answer.Tenant set: the entry point returns it to the caller
// unchanged (gRPC, Connect) or answers 401 (HTTP).
type TenantFunc func(ctx context.Context) (string, error)

// Scope is the set of calls within which one idempotency key names one
// operation.
type Scope int

const (
	// ScopeTenantOperation: a key is scoped to its tenant and operation, so
	// the same key on two operations names two. The default.
	ScopeTenantOperation Scope = iota
	// ScopeTenant: a key is scoped to its tenant only; using it on a second
	// operation is refused as a reused key.
	ScopeTenant
)

// options is shared by every call of one Engine; it is never modified after
// New.
type options struct {
	tenant       TenantFunc
	singleTenant bool
	keyRequired  bool
	scope        Scope
	lease        time.Duration
	maxLease     time.Duration
	retention    time.Duration
	retryAfter   time.Duration
	inProgress   time.Duration
	clockSkew    time.Duration
	failOpen     bool
	maxRecord    int
	sealer       Sealer // nil: outcomes are stored as they are
	logger       *slog.Logger
	hooks        *Hooks // nil: none

	meterProvider  metric.MeterProvider
	tracerProvider trace.TracerProvider

	err error // the first mistake an option found
}

// refuse notes the first mistake an option found, for New to return.
func (o *options) refuse(format string, args ...any) {
	if o.err == nil {
		o.err = fmt.Errorf("idemkey: "+format, args...)
	}
}

func newOptions(opts []Option) (*options, error) {
	o := &options{
		lease:      DefaultLease,
		maxLease:   DefaultMaxLease,
		retention:  DefaultRetention,
		retryAfter: DefaultMaxRetryAfter,
		inProgress: DefaultInProgressWait,
		clockSkew:  DefaultClockSkew,
		maxRecord:  DefaultMaxRecordSize,
		logger:     slog.Default(),

		meterProvider:  otel.GetMeterProvider(),
		tracerProvider: otel.GetTracerProvider(),
	}
	for _, opt := range opts {
		opt(o)
	}
	switch {
	case o.err != nil:
		return nil, o.err
	case o.tenant != nil && o.singleTenant:
		return nil, errors.New("idemkey: WithTenant and WithSingleTenant contradict each other: keep WithTenant for a service with several tenants")
	case o.retention < o.maxLease:
		return nil, fmt.Errorf("idemkey: the retention (%v, WithRetention) is shorter than the longest lease (%v, WithMaxLease): "+
			"a record would expire while its call may still run; lengthen the retention or shorten the maximum lease", o.retention, o.maxLease)
	}
	o.lease = min(o.lease, o.maxLease)
	return o, nil
}

// positive refuses a duration d of option name that is zero or negative.
func (o *options) positive(name string, d time.Duration, def time.Duration) bool {
	if d <= 0 {
		o.refuse("%s(%v): the duration must be positive; leave the option out for the default, %v", name, d, def)
		return false
	}
	return true
}

// WithTenant scopes keys to the tenant f returns, so that one caller's key
// never replays another's reply or holds another's key. An entry point
// refuses an engine with neither WithTenant nor WithSingleTenant: a shared
// key space is never the silent default.
func WithTenant(f TenantFunc) Option {
	return func(o *options) {
		if f == nil {
			o.refuse("WithTenant(nil): give it a function that reads the caller's identity, or use WithSingleTenant")
		}
		o.tenant = f
	}
}

// WithSingleTenant says that every caller shares one key space: right only
// for a service whose callers are one tenant (an internal API, a single
// customer's deployment), where any caller's key may replay to another.
func WithSingleTenant() Option { return func(o *options) { o.singleTenant = true } }

// WithKeyRequired refuses calls that carry no key (reason
// IDEMPOTENCY_KEY_MISSING). By default such calls run without protection.
func WithKeyRequired() Option { return func(o *options) { o.keyRequired = true } }

// WithScope sets the scope of a key; the default is ScopeTenantOperation.
func WithScope(s Scope) Option { return func(o *options) { o.scope = s } }

// WithLease sets how long a call without a deadline holds its key before a
// retry may presume it dead and run again (DefaultLease). A call with a
// deadline holds it for its remaining time plus a grace period. Either way
// the lease is at most WithMaxLease. New refuses a d of zero or less.
func WithLease(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithLease", d, DefaultLease) {
			o.lease = d
		}
	}
}

// WithMaxLease bounds every lease (DefaultMaxLease). New refuses a d of zero
// or less, or one longer than the retention.
func WithMaxLease(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithMaxLease", d, DefaultMaxLease) {
			o.maxLease = d
		}
	}
}

// WithRetention sets how long an outcome is kept and replayed, counted from
// the first call (DefaultRetention). After it the key is new again. A
// message consumer's ids must outlive the broker's redelivery (days: see
// package consumer). New refuses a d of zero or less, or one shorter than
// WithMaxLease.
func WithRetention(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithRetention", d, DefaultRetention) {
			o.retention = d
		}
	}
}

// WithClockSkew sets how far apart a client's clock and the store's may be
// (DefaultClockSkew), for a call that tells when its key's operation was
// first sent (request.FirstSent): a call first sent longer ago than the
// retention less the skew (or less half the retention, if that is less),
// whose key has no record, is answered Expired without running, since its
// record may have been there and expired; one first sent later than the
// skew from now is answered FirstSentInvalid. New refuses a d below zero.
func WithClockSkew(d time.Duration) Option {
	return func(o *options) {
		if d < 0 {
			o.refuse("WithClockSkew(%v): the skew cannot be negative; 0 trusts the clocks to agree", d)
		}
		o.clockSkew = max(d, 0)
	}
}

// WithMaxRetryAfter sets the longest wait asked of a retry that finds its key
// in progress, or a new key the store is too full for (DefaultMaxRetryAfter).
// The wait is never longer than the lease has left, nor shorter than a
// millisecond. New refuses a d of zero or less.
func WithMaxRetryAfter(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithMaxRetryAfter", d, DefaultMaxRetryAfter) {
			o.retryAfter = max(d, time.Millisecond)
		}
	}
}

// WithInProgressWait sets how long a duplicate that finds its key in progress
// waits for the first call to end before it is answered "in progress"
// (DefaultInProgressWait; 0 answers at once). The wait ends early with the
// first call's recorded reply, or, if the first call released its key, with a
// run of the handler; it never outlasts the duplicate's own deadline.
// Meanwhile the store is polled with a growing interval (25ms, doubling to
// 500ms): for the default, at most 9 reads. On a store that tells when the
// first call records or releases its key (store.Watcher: store/memory,
// store/redis, and store/postgres while its Listen runs), the duplicate
// reads it at once, in place of the poll due next, so that it has its
// answer the moment the record lands, at no more reads. The duplicates of
// one request (its key and fingerprint) that one Engine holds share a poll
// under way, so a flood of them told at once reads the key once, not once
// each. In atomic mode each poll
// is a Begin, which finds the key held and gives its connection back at
// once, so a waiting duplicate holds no connection between polls. New
// refuses a d below zero.
func WithInProgressWait(d time.Duration) Option {
	return func(o *options) {
		if d < 0 {
			o.refuse("WithInProgressWait(%v): the wait cannot be negative; 0 answers a duplicate at once", d)
		}
		o.inProgress = max(d, 0)
	}
}

// WithMaxRecordSize bounds the record of one outcome (DefaultMaxRecordSize);
// New refuses an n below MinRecordSize. Serve records the entry point's
// stand-in (Exchange.StandIn, a short error) in place of a larger one, which the caller gets too, as every retry
// will. A store with a bound on bytes (store/memory) sets this much room
// aside for each call while it runs (store.Reservation.MaxOutcome), so a
// bound near the largest real reply lets more calls run at once.
func WithMaxRecordSize(n int) Option {
	return func(o *options) {
		if n < MinRecordSize {
			o.refuse("WithMaxRecordSize(%d): a record needs at least %d bytes (MinRecordSize), room for the short error recorded in place of a reply too large to record", n, MinRecordSize)
		}
		o.maxRecord = max(n, MinRecordSize)
	}
}

// MinRecordSize is the least bound on a record: room for the stand-in
// (Exchange.StandIn) recorded in place of an outcome too large to record.
const MinRecordSize = 1024

// WithFailOpen runs the handler without protection when the store fails,
// instead of answering "store unavailable". Retries may then run the handler
// twice. Operations in atomic mode fail closed all the same, and a full store
// (store.ErrFull) refuses new keys: a bound is not a failure.
func WithFailOpen() Option { return func(o *options) { o.failOpen = true } }

// WithSealer seals every outcome before it reaches the store, and opens
// each record read back, with s: a *seal.KeyRing, which encrypts with
// AES-256-GCM bound to the record's key. A record that does not open (an
// unknown key, altered, copied from another key's record) is neither
// replayed nor run again: the call is answered StoreUnavailable, even with
// WithFailOpen, and logged at Error. Without a sealer, a sealed record is
// refused in the same way. Package seal has the details: rotation, records
// written before sealing was turned on, the format. A nil s seals nothing.
//
// WithMaxRecordSize bounds the outcome before sealing; the store holds
// s.Overhead() bytes more, and so does the stand-in (Exchange.StandIn)
// recorded in place of an outcome that cannot be (store.SmallOutcome before
// sealing). A store with bounds sets that much aside when the key is
// reserved: store.Reservation.MaxOutcome counts the overhead.
func WithSealer(s Sealer) Option {
	if v := reflect.ValueOf(s); v.Kind() == reflect.Pointer && v.IsNil() {
		s = nil // a nil *seal.KeyRing, say: none
	}
	return func(o *options) { o.sealer = s }
}

// WithLogger sets the logger for store failures and lost leases; the default
// is slog.Default(), and nil discards the records. The engine's own log
// records never hold a raw key, tenant or request.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l == nil {
			l = slog.New(slog.DiscardHandler)
		}
		o.logger = l
	}
}

// WithMeterProvider sets where the metrics go; the default is
// otel.GetMeterProvider(), which does nothing until an SDK is installed.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) {
		if mp != nil {
			o.meterProvider = mp
		}
	}
}

// WithTracerProvider sets the tracer of the spans of store operations, opened
// as children of the call's span and only when that one is recording; the
// default is otel.GetTracerProvider().
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) {
		if tp != nil {
			o.tracerProvider = tp
		}
	}
}
