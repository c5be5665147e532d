package consumer

import (
	"time"

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
		// none is spent sooner.
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

// WithEngineOptions sets options of the engine under the consumer, such as
// engine.WithLogger, engine.WithMeterProvider or engine.WithLease (how long
// a message is held before a redelivery presumes its first run dead).
// engine.WithTenant, WithKeyRequired and WithFailOpen have no effect here:
// the adapter reads the tenant from the message, an id is always required,
// and a consumer never runs a handler unprotected. engine.WithScope's
// ScopeTenant drops the consumer's name from the scope: two consumers on one
// store would then drop each other's messages as duplicates.
func WithEngineOptions(opts ...engine.Option) Option {
	return func(o *options) { o.engine = append(o.engine, opts...) }
}

// WithRetention sets how long a processed message's id is kept
// (DefaultRetention). A redelivery after it runs the handler again: keep it
// longer than the broker may redeliver (the adapters check).
func WithRetention(d time.Duration) Option {
	return WithEngineOptions(engine.WithRetention(d))
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
// (engine.WithLease changes it), and one that outlasts its lease may run
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
