package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Consumer processes the messages of one consumer, of a broker's type M,
// once per message id (see the package documentation), and settles each. It
// is safe for concurrent use: share one among a consumer's workers.
type Consumer[M any] struct {
	core
	b          Broker[M]
	h          func(ctx context.Context, m M) error
	id, tenant func(M) (string, error)
	dead       func(ctx context.Context, m M, err error) error
	attempts   int // a Broker's MaxAttempts; 0: the broker delivers again
}

// core is the part of a Consumer that knows no message type: it serves one
// Delivery, or a batch of them, on the engine.
type core struct {
	eng  *engine.Engine
	op   *engine.Operation
	opts *options
}

// New returns a Consumer named name that runs h for each message b reads,
// on eng, whose settings every entry point shares. The name scopes the
// message ids and names the consumer in metrics and logs. eng needs no
// tenant function (WithMessageTenant reads a message's), and its
// engine.WithFailOpen never applies to a consumer.
//
// New refuses a retention that the broker's horizon outlasts (a
// *HorizonError) unless WithHorizonWarning; no dead-letter hook unless
// WithDiscardDeadLetters; an option function of another message type;
// WithAtomic on a store that is not a store.Atomic; and a
// WithHandlerTimeout longer than the engine's longest lease allows.
func New[M any](eng *engine.Engine, name string, b Broker[M], h func(ctx context.Context, m M) error, opts ...Option) (*Consumer[M], error) {
	switch {
	case eng == nil:
		return nil, errors.New("idemkey/consumer: New needs an engine: engine.New(store, engine.WithRetention(consumer.RecommendedRetention))")
	case name == "":
		return nil, errors.New("idemkey/consumer: the consumer needs a name, which scopes its message ids")
	case b == nil || h == nil:
		return nil, errors.New("idemkey/consumer: New needs a broker (idemnats.New, idemamqp.New, idemkafka.New) and a handler")
	}
	o := newOptions(opts)
	id, err1 := typed[func(M) (string, error)]("WithMessageID", o.id)
	tenant, err2 := typed[func(M) (string, error)]("WithMessageTenant", o.tenant)
	dead, err3 := typed[func(context.Context, M, error) error]("WithDeadLetter", o.deadLetter)
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, err
	}
	if check, ok := b.(interface{ CheckTenantIDs(id any) error }); ok && tenant != nil {
		if err := check.CheckTenantIDs(o.id); err != nil {
			return nil, err
		}
	}
	if dead == nil && !o.discardDead {
		return nil, errNoDeadLetter
	}
	op, err := eng.Operation(engine.OperationSpec{
		Name:   name,
		Atomic: o.atomic,
		Metrics: engine.MetricsSpec{Attributes: []attribute.KeyValue{
			attribute.String("messaging.system", b.System()),
			attribute.String("messaging.consumer.group.name", name),
		}, Status: actionAttribute},
		OwnTenant:      true,
		KeyRequired:    true,
		Redelivers:     true,
		HandlerTimeout: o.handlerTimeout,
		Retention:      o.retention,
	})
	if err != nil {
		return nil, err
	}
	if id == nil {
		id = b.ID
	}
	c := &Consumer[M]{core: core{eng: eng, op: op, opts: o}, b: b, h: h, id: id, tenant: tenant, dead: dead}
	if r, ok := b.(interface{ MaxAttempts() int }); ok {
		c.attempts = max(r.MaxAttempts(), 1)
	}
	for _, h := range b.Horizons(o.maxBackoff) {
		if err := c.checkHorizon(h); err != nil {
			return nil, err
		}
	}
	return c, nil
}

var errNoDeadLetter = errors.New("idemkey/consumer: a message that fails for good, is refused, or fails for now on its last delivery has nowhere to go: " +
	"give WithDeadLetter a hook that keeps it (a subject, an exchange, a topic or a table of its own; idemkafka.DeadLetterTopic writes to a topic), " +
	"or consumer.WithDiscardDeadLetters() to settle such messages and lose them, logged at Error level")

// Handle runs the handler for m unless its id was processed before or is
// in progress, dead-letters it if its Result says so (a hook that fails
// makes it a Nak), settles it, and returns the Result. ctx bounds the
// store's operations and the handler. On a last delivery (Delivery.Last),
// Handle waits for another run that holds the id to end, and for a failing
// store to answer, each until ctx ends.
func (c *Consumer[M]) Handle(ctx context.Context, m M) Result {
	return c.HandleBatch(ctx, []M{m})[0]
}

// HandleBatch handles ms as Handle does each, and settles them once all are
// decided, returning their Results in order. On store/postgres one round
// trip decides the batch and, in atomic mode, one transaction commits it,
// each message's writes apart (docs/consumers.md, "Batches in detail").
func (c *Consumer[M]) HandleBatch(ctx context.Context, ms []M) []Result {
	results := make([]Result, len(ms))
	ds := make([]Delivery, len(ms))
	pending := make([]int, 0, len(ms))
	for i, m := range ms {
		d, err := c.read(m)
		switch {
		case err != nil:
			results[i] = c.deadLetter(ctx, m, Delivery{}, c.refused(ctx, err))
		case d.Skip != nil:
			results[i] = Result{Outcome: Retry, Action: Nak, Err: d.Skip}
		default:
			ds[i] = d
			pending = append(pending, i)
		}
	}
	for attempt := 1; len(pending) > 0; attempt++ {
		if c.attempts > 0 {
			if attempt > 1 && !store.Pause(ctx, longestDelay(results, pending)) {
				break
			}
			for _, i := range pending {
				ds[i].Attempt, ds[i].Redelivered, ds[i].Last = attempt, attempt > 1, attempt >= c.attempts
			}
		}
		c.serve(ctx, ms, ds, results, pending)
		if attempt >= c.attempts {
			break
		}
		pending = slices.DeleteFunc(pending, func(i int) bool { return results[i].Action != Nak })
	}
	if err := c.b.Settle(ctx, ms, results); err != nil {
		c.warn(ctx, "settling messages with the broker failed; it delivers them again, and they are dropped as duplicates", err)
	}
	return results
}

// read reads m's delivery, its id and its tenant; an error refuses m.
func (c *Consumer[M]) read(m M) (Delivery, error) {
	d, err := c.b.Read(m)
	if err != nil || d.Skip != nil {
		return d, err
	}
	if d.ID, err = c.id(m); err != nil {
		return d, err
	}
	if c.tenant != nil {
		d.Tenant, err = c.tenant(m)
	}
	return d, err
}

// serve sets results[i], for each i of pending, to one try of ms[i].
func (c *Consumer[M]) serve(ctx context.Context, ms []M, ds []Delivery, results []Result, pending []int) {
	if len(pending) == 1 {
		i := pending[0]
		results[i] = c.process(ctx, ds[i], func(ctx context.Context) error { return c.h(ctx, ms[i]) })
	} else {
		batch := make([]Delivery, len(pending))
		hs := make([]func(context.Context) error, len(pending))
		for j, i := range pending {
			batch[j], hs[j] = ds[i], func(ctx context.Context) error { return c.h(ctx, ms[i]) }
		}
		for j, res := range c.processBatch(ctx, batch, hs) {
			results[pending[j]] = res
		}
	}
	for _, i := range pending {
		results[i] = c.deadLetter(ctx, ms[i], ds[i], results[i])
	}
}

// longestDelay is the longest Delay of the pending results.
func longestDelay(results []Result, pending []int) time.Duration {
	var d time.Duration
	for _, i := range pending {
		d = max(d, results[i].Delay)
	}
	return d
}

// deadLetter hands m, delivered as d, to the dead-letter hook if res asks
// for it. A hook that fails makes res a Nak, so that the broker delivers m
// again; on m's last delivery, which the broker would not, it is tried
// again after each backoff until it takes m or ctx ends.
func (c *Consumer[M]) deadLetter(ctx context.Context, m M, d Delivery, res Result) Result {
	if !res.DeadLetter {
		return res
	}
	if c.dead == nil {
		c.logDead(ctx, res, "is discarded, with no dead letter (consumer.WithDiscardDeadLetters)")
		return res
	}
	for attempt := max(d.Attempt, 1); ; attempt++ {
		err := c.dead(ctx, m, res.Err)
		if err == nil {
			break
		}
		if !d.Last {
			c.warn(ctx, "the dead-letter hook failed; the message is redelivered", ownError(err))
			res.Action = Nak
			return res
		}
		c.warn(ctx, "the dead-letter hook failed on a message's last delivery; it is tried again until it takes the message", ownError(err))
		if !store.Pause(ctx, c.backoff(attempt)) {
			c.logDead(ctx, res, "was not taken by the dead-letter hook before the consumer stopped; it is negative-acknowledged, and the broker may not deliver it again")
			res.Action = Nak
			return res
		}
	}
	if errors.Is(res.Err, ErrLastDelivery) {
		c.logDead(ctx, res, "is dead-lettered")
	}
	return res
}

// logDead logs what became of res, a message to dead-letter.
func (c *core) logDead(ctx context.Context, res Result, what string) {
	c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a message that "+deadWhy(res)+" "+what,
		slog.String("operation", c.op.Name()), slog.String("outcome", res.Outcome.String()), slog.Any("error", ownError(res.Err)))
}

// Outcome is what became of one delivery.
type Outcome uint8

const (
	_           Outcome = iota // the zero Outcome is none of these
	Processed                  // the handler ran and succeeded; recorded
	Failed                     // the handler failed for good; recorded
	Retry                      // the handler failed for now; released
	Duplicate                  // processed before: dropped without running
	Busy                       // in progress elsewhere: redelivered later
	Rejected                   // no id, a malformed or reused one, a refused tenant, or sent before the retention: never runs
	StoreFailed                // the store failed, or had no room for a new record (Err is store.ErrFull): redelivered later
)

var outcomeNames = [...]string{"unknown", "processed", "failed", "retry", "duplicate", "busy", "rejected", "store_failed"}

func (o Outcome) String() string {
	if int(o) >= len(outcomeNames) {
		return "unknown"
	}
	return outcomeNames[o]
}

// Action is what the Broker tells the broker.
type Action uint8

const (
	_      Action = iota // the zero Action is none of these: a Broker redelivers
	Ack                  // acknowledge: the message is done with
	Nak                  // negative-acknowledge: redeliver after Result.Delay
	Reject               // terminate: never redeliver (JetStream Term, AMQP reject without requeue)
)

var actionNames = [...]string{"unknown", "ack", "nak", "reject"}

func (a Action) String() string {
	if int(a) >= len(actionNames) {
		return "unknown"
	}
	return actionNames[a]
}

// actionAttribute labels a message's idemkey.calls measurement with the
// Action it ended with.
func actionAttribute(action int) attribute.KeyValue {
	return attribute.String("idemkey.message.action", Action(action).String())
}

// Result is what became of one delivery.
type Result struct {
	Outcome Outcome
	Action  Action
	// Delay is how long to wait before the message is redelivered, when
	// Action is Nak.
	Delay time.Duration
	// DeadLetter is true when the message ended in a final failure (Failed,
	// or a Duplicate of a message that failed), was Rejected, or, on its last
	// delivery, failed for now or was still in progress elsewhere when the
	// delivery stopped waiting: it went to the dead-letter hook, and on the
	// hook's error was negative-acknowledged, with Delay, to try again.
	DeadLetter bool
	// Err says why, for all but Processed and Duplicate: the handler's error,
	// or one of this package's. This package logs only its own errors, never
	// the handler's or a message function's, which may quote the message.
	Err error
}

// String describes r for a log line: never the message's id or body.
func (r Result) String() string {
	if r.Action == Nak {
		return fmt.Sprintf("%s (%s after %s)", r.Outcome, r.Action, r.Delay.Round(time.Millisecond))
	}
	return fmt.Sprintf("%s (%s)", r.Outcome, r.Action)
}
