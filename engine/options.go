package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/idemkey/idemkey"
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

// Option configures an Engine. New refuses a value that makes no sense, such
// as a lease of zero or less, with an error that names the fix.
type Option func(*options)

// TenantFunc returns the authenticated tenant of a call, such as the
// identity an authentication layer put in ctx. Its error refuses the call:
// returned as it is over gRPC and Connect, 401 over HTTP.
type TenantFunc func(ctx context.Context) (string, error)

// Scope is the set of calls within which one key names one operation.
type Scope int

const (
	// ScopeTenantOperation, the default: the same key on two operations
	// names two.
	ScopeTenantOperation Scope = iota
	// ScopeTenant: a key used on a second operation is refused as reused.
	ScopeTenant
)

// options is never modified after New.
type options struct {
	tenant         TenantFunc
	singleTenant   bool
	keyRequired    bool
	scope          Scope
	lease          time.Duration
	maxLease       time.Duration
	retention      time.Duration
	retryAfter     time.Duration
	inProgress     time.Duration
	clockSkew      time.Duration
	region         string // WithRegion's; "": no fence
	failOpen       bool
	maxRecord      int
	sealer         Sealer // nil: outcomes are stored as they are
	logger         *slog.Logger
	hooks          *Hooks // nil: none
	meterProvider  metric.MeterProvider
	tracerProvider trace.TracerProvider
	err            error // the first mistake an option found
}

func (o *options) refuse(format string, args ...any) {
	if o.err == nil {
		o.err = fmt.Errorf("idemkey: "+format, args...)
	}
}

func newOptions(opts []Option) (*options, error) {
	o := &options{
		lease:          DefaultLease,
		maxLease:       DefaultMaxLease,
		retention:      DefaultRetention,
		retryAfter:     DefaultMaxRetryAfter,
		inProgress:     DefaultInProgressWait,
		clockSkew:      DefaultClockSkew,
		maxRecord:      DefaultMaxRecordSize,
		logger:         slog.Default(),
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

func (o *options) positive(name string, d time.Duration, def time.Duration) bool {
	if d <= 0 {
		o.refuse("%s(%v): the duration must be positive; leave the option out for the default, %v", name, d, def)
		return false
	}
	return true
}

// WithTenant scopes keys to the tenant f returns, so that one caller's key
// never replays another's reply or holds another's key.
func WithTenant(f TenantFunc) Option {
	return func(o *options) {
		if f == nil {
			o.refuse("WithTenant(nil): give it a function that reads the caller's identity, or use WithSingleTenant")
		}
		o.tenant = f
	}
}

// WithSingleTenant says that every caller shares one key space: right only
// for a service whose callers are one tenant, where any caller's key may
// replay to another.
func WithSingleTenant() Option { return func(o *options) { o.singleTenant = true } }

// WithKeyRequired refuses calls that carry no key (KeyMissing); by default
// they run unprotected.
func WithKeyRequired() Option { return func(o *options) { o.keyRequired = true } }

// WithScope sets the scope of a key (ScopeTenantOperation by default).
func WithScope(s Scope) Option { return func(o *options) { o.scope = s } }

// WithLease sets how long a call without a deadline holds its key before a
// retry may presume it dead and run again. A call with a deadline holds it
// for its remaining time plus a grace period, at most WithMaxLease.
func WithLease(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithLease", d, DefaultLease) {
			o.lease = d
		}
	}
}

// WithMaxLease bounds every lease; it must not exceed the retention.
func WithMaxLease(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithMaxLease", d, DefaultMaxLease) {
			o.maxLease = d
		}
	}
}

// WithRetention sets how long an outcome is kept and replayed, from the
// first call, at least WithMaxLease; after it the key is new again. A
// consumer's ids must outlive the broker's redelivery (package consumer).
func WithRetention(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithRetention", d, DefaultRetention) {
			o.retention = d
		}
	}
}

// WithClockSkew sets how far apart a client's clock and the store's may be,
// for a call first sent longer ago than the retention less the skew, without
// a record, which is answered Expired, or later than the skew from now,
// which is FirstSentInvalid.
func WithClockSkew(d time.Duration) Option {
	return func(o *options) {
		if d < 0 {
			o.refuse("WithClockSkew(%v): the skew cannot be negative; 0 trusts the clocks to agree", d)
		}
		o.clockSkew = max(d, 0)
	}
}

// WithRegion says that the engine serves region name (1 to 63 bytes of
// a-z, 0-9 and -, idemkey.ValidateRegion), one of several regions whose
// stores copy each other's records, and fences it: a call whose first
// region (Exchange.FirstRegion, idemkey.FirstRegionHeader) is another
// region's runs nothing here. Its key's record, once it has arrived, is
// replayed, and a record held is answered InProgress, as for any call; with
// no record the call is answered InProgress (its verdict Fenced) until the
// record arrives, or Expired if its first-sent time is older than the
// retention. So only the first region runs a key, at any replication lag:
// docs/regions.md. A call without a first region, or with this one, is
// served as usual; a malformed or repeated first region is
// FirstSentInvalid. An engine without WithRegion reads no first region.
func WithRegion(name string) Option {
	return func(o *options) {
		if err := idemkey.ValidateRegion(name); err != nil {
			o.refuse("WithRegion: %v", err)
		}
		o.region = name
	}
}

// WithMaxRetryAfter sets the longest wait asked of a retry that finds its
// key in progress or the store full; never longer than the lease has left,
// nor shorter than a millisecond.
func WithMaxRetryAfter(d time.Duration) Option {
	return func(o *options) {
		if o.positive("WithMaxRetryAfter", d, DefaultMaxRetryAfter) {
			o.retryAfter = max(d, time.Millisecond)
		}
	}
}

// WithInProgressWait sets how long a duplicate that finds its key in
// progress waits for the first call to end, never past its own deadline,
// before it is answered InProgress (0: at once). It polls the store from
// 25ms doubling to 500ms, and at once when a store.Watcher tells of a change.
func WithInProgressWait(d time.Duration) Option {
	return func(o *options) {
		if d < 0 {
			o.refuse("WithInProgressWait(%v): the wait cannot be negative; 0 answers a duplicate at once", d)
		}
		o.inProgress = max(d, 0)
	}
}

// WithMaxRecordSize bounds the record of one outcome (at least
// MinRecordSize); a larger one is replaced by a short stand-in, for the
// caller and every retry. store/memory sets this much aside for each running
// call, so a bound near the largest real reply lets more calls run at once.
func WithMaxRecordSize(n int) Option {
	return func(o *options) {
		if n < MinRecordSize {
			o.refuse("WithMaxRecordSize(%d): a record needs at least %d bytes (MinRecordSize), room for the short error recorded in place of a reply too large to record", n, MinRecordSize)
		}
		o.maxRecord = max(n, MinRecordSize)
	}
}

// MinRecordSize is the least bound on a record: room for the stand-in.
const MinRecordSize = 1024

// WithFailOpen runs the handler unprotected when the store fails, instead
// of answering StoreUnavailable: retries may then run it twice. Atomic mode
// fails closed all the same, and a full store refuses new keys.
func WithFailOpen() Option { return func(o *options) { o.failOpen = true } }

// WithSealer seals every outcome on its way to the store, and opens it on
// its way back, with s, such as a *seal.KeyRing; a nil s seals nothing. A
// record that does not open, or a sealed one without a sealer, is neither
// replayed nor run again: StoreUnavailable, even with WithFailOpen.
func WithSealer(s Sealer) Option {
	if v := reflect.ValueOf(s); v.Kind() == reflect.Pointer && v.IsNil() {
		s = nil // a nil *seal.KeyRing, say: none
	}
	return func(o *options) { o.sealer = s }
}

// WithLogger sets the logger (slog.Default() by default; nil discards).
// The engine's log records never hold a raw key, tenant or request.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l == nil {
			l = slog.New(slog.DiscardHandler)
		}
		o.logger = l
	}
}

// WithMeterProvider sets where the metrics go (otel.GetMeterProvider() by
// default, which does nothing until an SDK is installed).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) {
		if mp != nil {
			o.meterProvider = mp
		}
	}
}

// WithTracerProvider sets the tracer of the store operations' spans, opened
// only under a recording span (otel.GetTracerProvider() by default).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(o *options) {
		if tp != nil {
			o.tracerProvider = tp
		}
	}
}
