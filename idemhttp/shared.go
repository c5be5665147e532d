package idemhttp

import (
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkey/idemkey/engine"
)

// The settings every entry point shares, under the names they have in every
// entry point's package; package engine documents each in full.

// TenantFunc returns the authenticated tenant of a call, for example from
// the identity an authentication layer put in ctx. An error
// answers 401.
type TenantFunc = engine.TenantFunc

// Scope is the set of calls within which one idempotency key names one
// operation.
type Scope = engine.Scope

const (
	// ScopeTenantOperation: a key is scoped to its tenant and operation. The
	// default.
	ScopeTenantOperation = engine.ScopeTenantOperation
	// ScopeTenant: a key is scoped to its tenant only; using it on a second
	// operation is refused as a reused key.
	ScopeTenant = engine.ScopeTenant
)

// withEngine is an Option that sets engine options.
func withEngine(opts ...engine.Option) Option {
	return Option(func(o *options) { o.engine = append(o.engine, opts...) })
}

// WithTenant scopes keys to the tenant f returns. Without it every caller
// shares one key space, which is right only for single-tenant services.
func WithTenant(f TenantFunc) Option { return withEngine(engine.WithTenant(f)) }

// WithKeyRequired refuses calls that carry no key (reason
// IDEMPOTENCY_KEY_MISSING). By default such calls run without protection.
func WithKeyRequired() Option { return withEngine(engine.WithKeyRequired()) }

// WithScope sets the scope of a key; the default is ScopeTenantOperation.
func WithScope(s Scope) Option { return withEngine(engine.WithScope(s)) }

// WithLease sets how long a running call without a deadline holds its key
// before a retry may presume it dead (engine.WithLease).
func WithLease(d time.Duration) Option { return withEngine(engine.WithLease(d)) }

// WithMaxLease bounds every lease (engine.WithMaxLease).
func WithMaxLease(d time.Duration) Option { return withEngine(engine.WithMaxLease(d)) }

// WithRetention sets how long an outcome is kept and replayed, counted from
// the first call (engine.WithRetention). After it the key is new again.
func WithRetention(d time.Duration) Option { return withEngine(engine.WithRetention(d)) }

// WithClockSkew sets how far apart a client's clock and the store's may be
// (engine.WithClockSkew), for a request that sends Idempotency-First-Sent:
// one first sent longer ago than the retention less the skew, whose key has
// no record, is refused as expired rather than run; one first sent later
// than the skew from now is refused as invalid.
func WithClockSkew(d time.Duration) Option { return withEngine(engine.WithClockSkew(d)) }

// WithMaxRetryAfter sets the longest wait asked of a retry that finds its
// key in progress (engine.WithMaxRetryAfter).
func WithMaxRetryAfter(d time.Duration) Option { return withEngine(engine.WithMaxRetryAfter(d)) }

// WithInProgressWait sets how long a duplicate waits for the first call to
// end before it is answered "in progress" (engine.WithInProgressWait).
func WithInProgressWait(d time.Duration) Option { return withEngine(engine.WithInProgressWait(d)) }

// WithMaxRecordSize bounds the record of one outcome
// (engine.WithMaxRecordSize).
func WithMaxRecordSize(n int) Option { return withEngine(engine.WithMaxRecordSize(n)) }

// Sealer encrypts recorded outcomes at rest: a *seal.KeyRing.
type Sealer = engine.Sealer

// WithSealer seals every recorded outcome with s, and opens it for each
// replay (engine.WithSealer; package seal). A record that does not open is
// neither replayed nor run again: the call is answered as for a failed
// store, and the reason logged at Error.
func WithSealer(s Sealer) Option { return withEngine(engine.WithSealer(s)) }

// WithFailOpen runs the handler without protection when the store fails
// (engine.WithFailOpen); atomic mode fails closed all the same.
func WithFailOpen() Option { return withEngine(engine.WithFailOpen()) }

// WithLogger sets the logger for store failures and lost leases; nil
// discards the records (engine.WithLogger).
func WithLogger(l *slog.Logger) Option { return withEngine(engine.WithLogger(l)) }

// Hooks are the application's callbacks on how each call ended; see
// engine.Hooks and WithHooks.
type Hooks = engine.Hooks

// WithHooks calls the application's hooks once for each covered request
// (a covered method and a non-empty operation name): OnExecute when the
// handler ran, OnReplay when a retry got the recorded response, OnRefuse
// when the middleware answered without either (a problem, or a 401 for a
// refused tenant). Each gets an engine.Event whose Code is the HTTP status
// answered. A hook runs on the request's goroutine before the middleware
// writes the status of its own answer (a recorded, replayed or problem
// response), so that a client that has the response knows the hook has
// returned; for a request without a key, or one that failed open, the
// handler writes its own response first, and the hook runs after it. A
// panic in a hook is logged and changes neither the response nor the
// record (engine.WithHooks).
func WithHooks(h Hooks) Option { return withEngine(engine.WithHooks(h)) }

// WithMeterProvider sets where the metrics go (engine.WithMeterProvider).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return withEngine(engine.WithMeterProvider(mp))
}

// WithTracerProvider sets the tracer of store operations' spans
// (engine.WithTracerProvider).
func WithTracerProvider(tp trace.TracerProvider) Option {
	return withEngine(engine.WithTracerProvider(tp))
}
