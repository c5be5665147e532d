package consumer

import "time"

// RecommendedRetention is the retention to give engine.WithRetention for a
// consumer's engine: days, not the hours of an API's key
// (engine.DefaultRetention), since a processed message's id must outlive
// every redelivery of it, and a consumer may be down for a weekend. The
// adapters compare the engine's retention with the broker's redelivery
// horizon (CheckHorizon), whatever it is.
const RecommendedRetention = 7 * 24 * time.Hour

// Defaults of a consumer, each changed by the option that names it.
const (
	defaultFirstBackoff = time.Second // WithBackoff
	defaultMaxBackoff   = time.Minute // WithBackoff
)

// Option configures a Consumer.
type Option func(*options)

type options struct {
	system         string
	atomic         bool
	handlerTimeout time.Duration
	final          func(error) bool
	firstBackoff   time.Duration
	maxBackoff     time.Duration
	warnHorizon    bool
	// discardDeadLetters lets an adapter run without a dead-letter hook
	// (WithDiscardDeadLetters).
	discardDeadLetters bool
}

func newOptions(opts []Option) *options {
	o := &options{
		system:       "unknown",
		final:        IsFinal,
		firstBackoff: defaultFirstBackoff,
		maxBackoff:   defaultMaxBackoff,
	}
	for _, opt := range opts {
		opt(o)
	}
	return o
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

// WithHandlerTimeout bounds each run of the handler (engine.OperationSpec's
// HandlerTimeout): its context ends after d. Its lease, the time before a
// redelivery may presume it dead, is then the timeout plus a few seconds
// (five): New refuses a d whose lease the engine's longest lease
// (engine.WithMaxLease, ten minutes by default) would cut short. Without it
// a handler runs unbounded under the engine's lease (engine.WithLease,
// engine.DefaultLease by default), and one that outlasts its lease may run
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
// the broker counts, at most most (by default 1s and 1m).
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

// WithDiscardDeadLetters says what becomes of a message that would be
// dead-lettered (Result.DeadLetter: a final failure, a refusal, a failure
// for now on its last delivery) when the adapter has no dead-letter hook:
// it is discarded, acknowledged (or, refused, terminated) and logged at
// Error level, and nothing keeps it. The broker adapters' New refuses a
// consumer with no dead-letter hook without it, so that no message is lost
// unless the user says so.
func WithDiscardDeadLetters() Option { return func(o *options) { o.discardDeadLetters = true } }

// WithHorizonWarning makes CheckHorizon log its finding at Error level and
// return nil, instead of refusing to start: for a broker whose redelivery
// horizon is unbounded or longer than the retention, when its operator
// accepts that a message redelivered that late runs again.
func WithHorizonWarning() Option { return func(o *options) { o.warnHorizon = true } }
