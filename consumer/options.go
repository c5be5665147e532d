package consumer

import (
	"context"
	"fmt"
	"reflect"
	"time"
)

// RecommendedRetention is the retention to give a consumer's engine
// (engine.WithRetention): an id must outlive every redelivery, and a
// consumer may be down for a weekend.
const RecommendedRetention = 7 * 24 * time.Hour

const (
	defaultFirstBackoff = time.Second // WithBackoff
	defaultMaxBackoff   = time.Minute // WithBackoff
)

// Option configures a Consumer.
type Option func(*options)

type options struct {
	atomic                 bool
	retention              time.Duration
	handlerTimeout         time.Duration
	final                  func(error) bool
	firstBackoff           time.Duration
	maxBackoff             time.Duration
	warnHorizon            bool
	discardDead            bool
	id, tenant, deadLetter any // functions of the broker's message type
}

func newOptions(opts []Option) *options {
	o := &options{final: IsFinal, firstBackoff: defaultFirstBackoff, maxBackoff: defaultMaxBackoff}
	for _, opt := range opts {
		opt(o)
	}
	return o
}

// typed is f, an option's function, as an F; nil is F's zero value.
func typed[F any](option string, f any) (F, error) {
	var zero F
	if f == nil {
		return zero, nil
	}
	g, ok := f.(F)
	if !ok {
		return zero, fmt.Errorf("idemkey/consumer: %s's function is a %T, but this broker's needs a %s", option, f, reflect.TypeFor[F]())
	}
	return g, nil
}

// WithMessageID sets how a message's id is read (the Broker's ID by
// default: idemnats.MessageID, idemamqp.MessageID, idemkafka.MessageID); an
// error refuses the message. M is the broker's message type.
func WithMessageID[M any](f func(M) (string, error)) Option {
	return func(o *options) {
		if f != nil {
			o.id = f
		}
	}
}

// WithMessageTenant scopes message ids to the tenant f reads from a message,
// for example from a header its producer sets; an error refuses the
// message. A broker that drops duplicates of its own ids across tenants
// (JetStream) refuses a consumer whose ids could collide (see
// idemnats.New).
func WithMessageTenant[M any](f func(M) (string, error)) Option {
	return func(o *options) {
		if f != nil {
			o.tenant = f
		}
	}
}

// WithDeadLetter sets the hook that keeps a message that failed for good, was
// refused, or failed for now on its last delivery (Result.DeadLetter), before
// it is settled: err says why (Cause words it safely; err's own words may
// quote the message). If the hook fails, the message is delivered again and
// handed to it again. New refuses a consumer with no hook unless
// WithDiscardDeadLetters says to lose such messages.
func WithDeadLetter[M any](f func(ctx context.Context, m M, err error) error) Option {
	return func(o *options) {
		if f != nil {
			o.deadLetter = f
		}
	}
}

// WithRetention keeps the consumer's records for d, in place of its
// engine's retention (engine.WithRetention), which it then need not be:
// one engine can serve a consumer whose ids are kept a week and calls whose
// keys are kept a day. New refuses a d shorter than the engine's longest
// lease, or than the broker's redelivery horizon.
func WithRetention(d time.Duration) Option { return func(o *options) { o.retention = max(d, 0) } }

// WithAtomic runs each handler in a transaction of the store's
// (store.Atomic: store/postgres) that commits with the message's record, so
// its writes (through postgres.TxFromContext) take effect exactly once.
func WithAtomic() Option { return func(o *options) { o.atomic = true } }

// WithHandlerTimeout bounds each run of the handler to d, and makes its
// lease d plus five seconds (at most engine.WithMaxLease). Without it, a
// handler that outlasts the engine's lease may run again beside itself in
// two-phase mode.
func WithHandlerTimeout(d time.Duration) Option {
	return func(o *options) { o.handlerTimeout = max(d, 0) }
}

// WithClassifier sets which of a handler's errors are final (IsFinal by
// default): recorded and dead-lettered. The others release the message's id
// and have it delivered again after a backoff.
func WithClassifier(final func(error) bool) Option {
	return func(o *options) {
		if final != nil {
			o.final = final
		}
	}
}

// WithBackoff sets the delay before a message that failed for now is
// delivered again: first after its first delivery, doubling with each
// delivery the broker counts, at most most (1s and 1m by default), less a
// random part of up to a quarter. Values of zero or less keep the defaults.
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

// WithDiscardDeadLetters lets a consumer run with no dead-letter hook: a
// message that would be dead-lettered is settled (acknowledged, or, refused,
// rejected), logged at Error level, and kept by nothing.
func WithDiscardDeadLetters() Option { return func(o *options) { o.discardDead = true } }

// WithHorizonWarning makes New log a horizon longer than the retention at
// Error level rather than refuse it: for an operator who accepts that a
// message delivered again that late runs again.
func WithHorizonWarning() Option { return func(o *options) { o.warnHorizon = true } }
