package consumer

import (
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkey/idemkey/engine"
)

// Defaults of a consumer, each changed by the option that names it.
const (
	// DefaultRetention is how long a processed message's id is kept
	// (WithRetention): days, not the hours of an API key, since it must
	// outlast every redelivery, and a consumer may be down for a weekend.
	DefaultRetention    = 7 * 24 * time.Hour
	DefaultFirstBackoff = time.Second // WithBackoff
	DefaultMaxBackoff   = time.Minute // WithBackoff
)

// Option configures a Consumer.
type Option func(*options)

type options struct {
	engine         []engine.Option
	system         string
	atomic         bool
	handlerTimeout time.Duration
	final          func(error) bool
	firstBackoff   time.Duration
	maxBackoff     time.Duration
	warnHorizon    bool
}

func newOptions(opts []Option) *options {
	o := &options{
		// A redelivery that finds its message in progress elsewhere is
		// negative-acknowledged at once rather than held, so that the worker
		// moves on, and delayed until the other run's lease ends: that run
		// acknowledges the message, or, if it died, the redelivery then
		// takes over. Every delivery counts against a broker's limit, so
		// none is spent sooner. (The last delivery waits instead: see
		// Consumer.lastBusy.)
		engine: []engine.Option{engine.WithRetention(DefaultRetention), engine.WithInProgressWait(0),
			engine.WithMaxRetryAfter(engine.DefaultMaxLease)},
		system:       "unknown",
		final:        IsFinal,
		firstBackoff: DefaultFirstBackoff,
		maxBackoff:   DefaultMaxBackoff,
	}
	for _, opt := range opts {
		opt(o)
	}
	return o
}

// withEngine is an Option that sets engine options.
func withEngine(opts ...engine.Option) Option {
	return func(o *options) { o.engine = append(o.engine, opts...) }
}

// The settings a consumer shares with the other entry points, under the
// names they have in every entry point's package. The others have no
// meaning here: the adapter reads the tenant from the message, an id is
// always required, a consumer never runs a handler unprotected, and a
// message in progress elsewhere is negative-acknowledged at once, or, on its
// last delivery, waited for by polling the store.

// WithRetention sets how long a processed message's id is kept
// (DefaultRetention). A redelivery after it runs the handler again: keep it
// longer than the broker may redeliver (the adapters check).
func WithRetention(d time.Duration) Option { return withEngine(engine.WithRetention(d)) }

// WithClockSkew sets how far the broker's clock, which stamps a message's
// Delivery.Sent, may be from the store's (engine.WithClockSkew): a message
// sent longer ago than the retention less the skew, whose id has no
// record, is refused with ErrExpired.
func WithClockSkew(d time.Duration) Option { return withEngine(engine.WithClockSkew(d)) }

// WithLease sets how long a message without WithHandlerTimeout is held before
// a redelivery presumes its first run dead (engine.WithLease).
func WithLease(d time.Duration) Option { return withEngine(engine.WithLease(d)) }

// WithMaxRetryAfter bounds how long a message found in progress elsewhere is
// held back before its redelivery (engine.WithMaxRetryAfter). By default it
// waits out the other run's lease.
func WithMaxRetryAfter(d time.Duration) Option { return withEngine(engine.WithMaxRetryAfter(d)) }

// WithMaxRecordSize bounds the record of one outcome
// (engine.WithMaxRecordSize).
func WithMaxRecordSize(n int) Option { return withEngine(engine.WithMaxRecordSize(n)) }

// Sealer encrypts recorded outcomes at rest: a *seal.KeyRing.
type Sealer = engine.Sealer

// WithSealer seals each message's record with s, and opens it when a
// redelivery reads it (engine.WithSealer; package seal). A consumer records
// only whether a message was processed or failed, never the handler's data,
// so there is nothing to redact; sealing still keeps anyone who can write
// the store from turning a failed message into a processed one or the
// reverse. A record that does not open is neither acknowledged as a
// duplicate nor processed again: the delivery is answered StoreUnavailable
// (negative-acknowledged, and dead-lettered on its last delivery).
func WithSealer(s Sealer) Option { return withEngine(engine.WithSealer(s)) }

// WithLogger sets the logger for store failures, lost leases and dead
// letters; nil discards the records (engine.WithLogger).
func WithLogger(l *slog.Logger) Option { return withEngine(engine.WithLogger(l)) }

// Hooks are the application's callbacks on how each message ended; see
// engine.Hooks and WithHooks.
type Hooks = engine.Hooks

// WithHooks calls the application's hooks once for each delivery that
// Process or Refuse decides: OnExecute when the handler ran (Processed,
// Failed, Retry; engine.Event.Recorded is false for Retry, whose id is
// released), OnReplay for a Duplicate, OnRefuse when the handler did not
// run for another reason (Busy, Refused, StoreUnavailable, StoreFull). A
// message redelivered n times after it was processed runs OnExecute once
// and OnReplay n times. The Event's Key is the message id, its Tenant the
// message's tenant, its Code the Action (Ack, Nak, Reject), its Size the
// record's (a message's is a few bytes: processed or failed). A hook runs
// on the worker's goroutine before Process returns, so before the adapter
// acknowledges the message, and delays it as long as it takes; a panic in
// it is logged and changes neither the Result nor the record
// (engine.WithHooks).
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

// WithSystem names the broker in the metrics' messaging.system attribute:
// "nats", "rabbitmq" (OpenTelemetry's names). Without it, "unknown".
func WithSystem(name string) Option { return func(o *options) { o.system = name } }

// WithAtomic runs each handler in a transaction of the store's that commits
// with the message's record (the store must implement store.Atomic, as
// store/postgres does): the handler's writes take effect exactly once, even
// when the consumer dies at any point. The handler writes through the
// transaction in its context (postgres.TxFromContext).
func WithAtomic() Option { return func(o *options) { o.atomic = true } }

// WithHandlerTimeout bounds each handler's run; its lease, the time before a
// redelivery may presume it dead, is then the timeout plus a few seconds.
// Without it a handler runs unbounded under engine.DefaultLease
// (WithLease changes it), and one that outlasts its lease may run
// again beside itself in two-phase mode.
func WithHandlerTimeout(d time.Duration) Option {
	return func(o *options) { o.handlerTimeout = max(d, 0) }
}

// WithClassifier sets which of a handler's errors are final (IsFinal by
// default): recorded, acknowledged and dead-lettered. The others release the
// message's id and negative-acknowledge it with a backoff.
func WithClassifier(final func(error) bool) Option {
	return func(o *options) {
		if final != nil {
			o.final = final
		}
	}
}

// WithBackoff sets the delay before a message that failed for now is
// redelivered: first after its first delivery, doubling with each delivery
// the broker counts, at most max (DefaultFirstBackoff, DefaultMaxBackoff).
// Values of zero or less keep the defaults.
func WithBackoff(first, most time.Duration) Option {
	return func(o *options) {
		if first > 0 {
			o.firstBackoff = first
		}
		if most > 0 {
			o.maxBackoff = most
		}
		o.maxBackoff = max(o.maxBackoff, o.firstBackoff)
	}
}

// WithHorizonWarning makes CheckHorizon log its finding at Error level and
// return nil, instead of refusing to start: for a broker whose redelivery
// horizon is unbounded or longer than the retention, when its operator
// accepts that a message redelivered that late runs again.
func WithHorizonWarning() Option { return func(o *options) { o.warnHorizon = true } }
