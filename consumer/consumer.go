package consumer

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Consumer processes the messages of one consumer once per message id:
// exactly once in atomic mode, and in two-phase mode again only after a run
// that died or outlasted its lease (see the package documentation). It is
// safe for concurrent use: share one among a consumer's workers.
type Consumer struct {
	eng  *engine.Engine
	op   *engine.Operation
	opts *options
}

// New returns a Consumer named name on st. The name scopes the message ids,
// so two consumers of one stream each process every message once; it names
// the consumer in metrics and logs too.
func New(st store.Store, name string, opts ...Option) (*Consumer, error) {
	if name == "" {
		return nil, errors.New("idemkey/consumer: the consumer needs a name, which scopes its message ids")
	}
	o := newOptions(opts)
	eng := engine.New(st, o.engine...)
	op, err := eng.Operation(engine.OperationSpec{
		Name:   name,
		Atomic: o.atomic,
		Metrics: engine.MetricsSpec{Attributes: []attribute.KeyValue{
			attribute.String("messaging.system", o.system),
			attribute.String("messaging.consumer.group.name", name),
		}, Status: actionAttribute},
	})
	if err != nil {
		return nil, err
	}
	return &Consumer{eng: eng, op: op, opts: o}, nil
}

// Name is the consumer's name.
func (c *Consumer) Name() string { return c.op.Name() }

// Retention is how long a processed message's record is kept: a redelivery
// after it runs the handler again.
func (c *Consumer) Retention() time.Duration { return c.eng.Retention() }

// Delivery is what an adapter read from one delivery of a message.
type Delivery struct {
	// ID is the producer-assigned message id: the key. Empty when the
	// message has none, which is refused.
	ID string
	// Tenant scopes the id, if the consumer serves several tenants.
	Tenant string
	// Body is fingerprinted: an id first seen with another body is refused
	// as reused.
	Body []byte
	// Attempt counts this message's deliveries, from 1, where the broker
	// tells it; 0 when it does not. It sets the backoff.
	Attempt int
	// Redelivered is true when the broker marks the delivery as a later one:
	// its record is read before anything is reserved.
	Redelivered bool
	// Last is true when the broker will not deliver the message again
	// (JetStream's max deliver, a quorum queue's delivery limit): a message
	// that would be redelivered is dead-lettered instead, and acknowledged,
	// and one in progress elsewhere is waited for (see the package
	// documentation).
	Last bool
	// Sent is when the message was first published, as the broker tells it
	// (JetStream's stored time, AMQP's timestamp property), or zero. A
	// message sent longer ago than the retention (less WithClockSkew)
	// whose id has no record is refused with ErrExpired, not processed:
	// its record may have been there, and expired. A Sent in the future
	// counts as unknown: a publisher's clock that runs ahead refuses
	// nothing.
	Sent time.Time
}

// request is what the engine is asked for d.
func (d Delivery) request() engine.Request {
	r := engine.Request{Tenant: d.Tenant, Key: d.ID, Fingerprint: sha256.Sum256(d.Body), Retried: d.Redelivered}
	if !d.Sent.After(time.Now()) {
		r.FirstSent = d.Sent
	}
	return r
}

// Handler processes one message. In atomic mode ctx carries the store's
// transaction: its writes commit with the message's record.
//
// Its error decides what becomes of the message (see WithClassifier): by
// default a gRPC status with a code the gRPC interceptor records, or an
// error wrapped with Final, is a final failure (recorded, acknowledged, dead
// letter); any other error is transient (the key is released and the message
// redelivered after a backoff).
type Handler func(ctx context.Context) error

// Outcome is what became of one delivery.
type Outcome uint8

const (
	_                Outcome = iota // the zero Outcome is none of these
	Processed                       // the handler ran and succeeded; recorded
	Failed                          // the handler failed for good; recorded
	Retry                           // the handler failed for now; released
	Duplicate                       // processed before: dropped without running
	Busy                            // in progress elsewhere: redelivered later
	Refused                         // no id, a malformed or reused one, a refused tenant, or sent before the retention: never runs
	StoreUnavailable                // the store failed: redelivered later
	StoreFull                       // no room for a new record: redelivered later
)

var outcomeNames = [...]string{"unknown", "processed", "failed", "retry", "duplicate", "busy", "refused", "store_unavailable", "store_full"}

func (o Outcome) String() string {
	if int(o) >= len(outcomeNames) {
		return "unknown"
	}
	return outcomeNames[o]
}

// Action is what the adapter tells the broker.
type Action uint8

const (
	_      Action = iota // the zero Action is none of these: an adapter redelivers
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

// Result is what Process decided for one delivery.
type Result struct {
	Outcome Outcome
	Action  Action
	// Delay is how long to wait before the message is redelivered, when
	// Action is Nak.
	Delay time.Duration
	// DeadLetter is true when the message ended in a final failure (Failed,
	// or a Duplicate of a message that failed), was Refused, or, on its last
	// delivery, failed for now or was still in progress elsewhere when the
	// delivery stopped waiting: the adapter hands it to its dead-letter hook
	// before it acts, and on the hook's error negative-acknowledges it
	// instead, with Delay. So a dead letter is sent at least once, even by a
	// redelivery of a message whose failure was recorded, as long as the
	// broker redelivers: a hook that fails on the last delivery loses it.
	DeadLetter bool
	// Err says why, for Failed, Retry, Refused, the store's outcomes and a
	// dead-lettered Busy: the handler's error, or one of this package's.
	// This package logs only its own errors, never the handler's or an
	// adapter function's, which may hold what the message held.
	Err error
}

// This package's errors in a Result, checked with errors.Is.
var (
	ErrNoID         = errors.New("idemkey/consumer: the message has no id")
	ErrInvalidID    = errors.New("idemkey/consumer: the message id is longer than 255 bytes")
	ErrReusedID     = errors.New("idemkey/consumer: the message id was first used with another body")
	ErrFailedBefore = errors.New("idemkey/consumer: the message failed when first processed")
	ErrExpired      = errors.New("idemkey/consumer: the message was sent longer ago than its id's record is kept, and the id has no record")
	// ErrLastDelivery wraps the reason a message would have been redelivered
	// on its last delivery (Delivery.Last): it is dead-lettered instead.
	ErrLastDelivery = errors.New("idemkey/consumer: the broker will not deliver the message again")
)

// Records of a processed message: what a redelivery finds.
var (
	recordProcessed = []byte("processed")
	recordFailed    = []byte("failed")
)

// Process decides what to do with one delivery, running h unless its id was
// processed before or is in progress, and returns what the adapter tells the
// broker. ctx bounds the store's operations and h; WithHandlerTimeout bounds
// each run of h further and sets its lease.
//
// On a message's last delivery (Delivery.Last), Process does not return
// while another run holds the id: it waits for that run to end, so as to
// take the message over (see the package documentation).
func (c *Consumer) Process(ctx context.Context, d Delivery, h Handler) Result {
	call := c.eng.Call(c.op)
	return c.end(ctx, &call, d, h, c.attempt(ctx, &call, d, h))
}

// end is the final Result of a delivery that res answers, on its last
// delivery too, and ends its call.
func (c *Consumer) end(ctx context.Context, call *engine.Call, d Delivery, h Handler, res Result) Result {
	if d.Last && res.Outcome == Busy {
		res = c.lastBusy(ctx, call, d, h, res)
	}
	if d.Last && res.Action == Nak {
		res = c.lastDelivery(ctx, call, res)
	}
	call.End(ctx, int(res.Action))
	return res
}

// attempt is process under the handler timeout, which starts anew with each
// attempt: it bounds one run of h, and sets the lease of the reservation
// that precedes it.
func (c *Consumer) attempt(ctx context.Context, call *engine.Call, d Delivery, h Handler) Result {
	ctx, cancel := c.timed(ctx)
	defer cancel()
	return c.process(ctx, call, d, h)
}

// timed is ctx bounded by the handler timeout (WithHandlerTimeout), if any.
func (c *Consumer) timed(ctx context.Context) (context.Context, context.CancelFunc) {
	if c.opts.handlerTimeout > 0 {
		return context.WithTimeout(ctx, c.opts.handlerTimeout)
	}
	return ctx, func() {}
}

// Polls of the last delivery of a message in progress elsewhere: the first
// after lastBusyFirstPoll, each next one twice as late, at most
// lastBusyMaxPoll apart, and never later than the other run's lease ends.
const (
	lastBusyFirstPoll = 50 * time.Millisecond
	lastBusyMaxPoll   = time.Second
)

// lastBusyWait bounds the wait of a last delivery for the runs that hold its
// id: no run holds it longer than a lease, at most engine.DefaultMaxLease
// (a consumer sets no other maximum), so a wait this long means that other
// runs took the id again and again.
const lastBusyWait = engine.DefaultMaxLease

// errStillBusy is why a last delivery that stopped waiting, with its message
// still in progress elsewhere, is dead-lettered.
var errStillBusy = errors.New("idemkey/consumer: the message was still in progress elsewhere")

// lastBusy is the Result of the last delivery of a message that res found
// in progress elsewhere. The broker will not deliver it again, so it cannot
// be left to the run that holds the id: if that run then failed for now, it
// would release the id and negative-acknowledge a message that the broker
// no longer redelivers, and the message would be lost. So the last delivery
// waits for that run to end, polling the store (each poll a reservation,
// which takes the id over once its lease has ended): a record ends it as a
// Duplicate; a released id, or one whose lease ended, is run here, and
// dead-lettered by lastDelivery if it fails for now again. If the wait ends
// first (ctx is done, or lastBusyWait passed), the result stays Busy, and
// lastDelivery dead-letters it: at least once, since the other run may yet
// succeed.
func (c *Consumer) lastBusy(ctx context.Context, call *engine.Call, d Delivery, h Handler, res Result) Result {
	call.Log(ctx, slog.LevelWarn, "the last delivery of a message found it in progress elsewhere; it waits for that run to end", ErrLastDelivery)
	end := time.Now().Add(lastBusyWait)
	for poll := lastBusyFirstPoll; res.Outcome == Busy; poll = min(2*poll, lastBusyMaxPoll) {
		left := time.Until(end)
		if left <= 0 {
			res.Err = errStillBusy
			return res
		}
		select {
		case <-ctx.Done():
			res.Err = fmt.Errorf("%w: %w", errStillBusy, ctx.Err())
			return res
		case <-time.After(min(poll, res.Delay, left)): // res.Delay: the other run's lease left
		}
		res = c.attempt(ctx, call, d, h)
	}
	return res
}

// lastDelivery is the Result of a message that would be redelivered, on its
// last delivery: one that failed for now, met a failing store, or was still
// in progress elsewhere when lastBusy stopped waiting. It is dead-lettered
// and acknowledged: the broker would drop it.
func (c *Consumer) lastDelivery(ctx context.Context, call *engine.Call, res Result) Result {
	msg := "the last delivery of a message failed for now; it is dead-lettered and acknowledged"
	if res.Outcome == Busy {
		msg = "the last delivery of a message stopped waiting for the run that holds it; it is dead-lettered and acknowledged"
	}
	call.Log(ctx, slog.LevelError, msg, ErrLastDelivery)
	res.Action, res.DeadLetter = Ack, true
	res.Err = fmt.Errorf("%w: %w", ErrLastDelivery, res.Err)
	return res
}

func (c *Consumer) process(ctx context.Context, call *engine.Call, d Delivery, h Handler) Result {
	switch {
	case d.ID == "":
		call.Verdict = engine.KeyMissing
		return c.refuse(ctx, call, ErrNoID)
	case len(d.ID) > idemkey.MaxKeyLen:
		call.Verdict = engine.KeyInvalid
		return c.refuse(ctx, call, ErrInvalidID)
	}
	call.Start(ctx, d.request())
	if call.Verdict == engine.Executed {
		return c.run(ctx, call, d, h)
	}
	return c.answer(ctx, call, d)
}

// answer is the Result of a message whose handler did not run, as
// call.Verdict says.
func (c *Consumer) answer(ctx context.Context, call *engine.Call, d Delivery) Result {
	switch call.Verdict {
	case engine.Replayed:
		if string(call.Outcome) == string(recordFailed) {
			return Result{Outcome: Duplicate, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: ErrFailedBefore}
		}
		return Result{Outcome: Duplicate, Action: Ack}
	case engine.InProgress:
		return Result{Outcome: Busy, Action: Nak, Delay: call.RetryAfter}
	case engine.Reused:
		return c.refuse(ctx, call, ErrReusedID)
	case engine.Expired:
		return c.refuse(ctx, call, ErrExpired)
	case engine.StoreFull:
		return Result{Outcome: StoreFull, Action: Nak, Delay: c.backoff(d.Attempt), Err: store.ErrFull}
	default: // StoreUnavailable; a consumer never fails open
		err := ctx.Err()
		if err == nil {
			err = errors.New("idemkey/consumer: the store is unavailable")
		}
		return Result{Outcome: StoreUnavailable, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}
	}
}

// run runs h for a message whose id the call holds, and records or releases
// it by h's error.
func (c *Consumer) run(ctx context.Context, call *engine.Call, d Delivery, h Handler) Result {
	defer call.Abandon(ctx) // a panic releases the id, then propagates
	err := h(call.Context(ctx))
	if err != nil && !c.opts.final(err) {
		call.Release(ctx)
		return Result{Outcome: Retry, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}
	}
	outcome, res := recordProcessed, Result{Outcome: Processed, Action: Ack}
	if err != nil {
		outcome = recordFailed
		res = Result{Outcome: Failed, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: err}
	}
	switch rerr := call.Record(ctx, outcome, err == nil); {
	case rerr == nil:
	case errors.Is(rerr, engine.ErrSuperseded):
		// Another run recorded the message first; this one's writes
		// were rolled back.
		return c.answer(ctx, call, d)
	case errors.Is(rerr, store.ErrFull) && !call.Atomic():
		// The handler's effects happened and no record could be written:
		// acknowledging keeps them to one, and the key stays in progress
		// until its lease ends, so a duplicate meanwhile is delayed.
		call.Log(ctx, slog.LevelWarn, "no room to record a processed message; it is acknowledged all the same", rerr)
	default:
		// Atomic mode: the commit failed, or its fate is unknown. The
		// redelivery finds out: a committed record drops it.
		return Result{Outcome: StoreUnavailable, Action: Nak, Delay: c.backoff(d.Attempt), Err: rerr}
	}
	return res
}

// Refuse is the Result of a message the adapter refuses before Process: its
// id or tenant could not be read (err says why). It is counted and logged
// like the refusals of Process.
func (c *Consumer) Refuse(ctx context.Context, err error) Result {
	call := c.eng.Call(c.op)
	res := c.refuse(ctx, &call, err)
	call.End(ctx, int(res.Action))
	return res
}

func (c *Consumer) refuse(ctx context.Context, call *engine.Call, err error) Result {
	call.Log(ctx, slog.LevelError, "message refused; it is terminated, or dead-lettered, without running", ownError(err))
	return Result{Outcome: Refused, Action: Reject, DeadLetter: true, Delay: c.backoff(1), Err: err}
}

// backoff is the delay before the attempt-th delivery's next one: the first
// backoff, doubling with each attempt up to the maximum, less a random part
// of up to a quarter, so that messages that failed together spread out.
func (c *Consumer) backoff(attempt int) time.Duration {
	d := c.opts.firstBackoff
	for i := 1; i < attempt && d < c.opts.maxBackoff; i++ {
		if d > c.opts.maxBackoff/2 { // doubling would pass the maximum, or overflow
			d = c.opts.maxBackoff
			break
		}
		d *= 2
	}
	d = min(d, c.opts.maxBackoff)
	return d - rand.N(d/4+1)
}

// Final marks err as a final failure: the message is recorded as failed,
// acknowledged and dead-lettered, and never runs again.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return finalError{err}
}

type finalError struct{ error }

func (e finalError) Unwrap() error { return e.error }

// IsFinal is the default classification of a handler's error: final when it
// is marked with Final, or is a gRPC status whose code the gRPC interceptor
// records (NotFound, AlreadyExists, FailedPrecondition, OutOfRange,
// Unimplemented, Internal, Unknown, DataLoss), or InvalidArgument, which a
// redelivery of the same message can only repeat; transient otherwise,
// including a plain error, which is what a failing dependency returns.
// Unknown counts only as an explicit status, for an effect whose outcome is
// unknown (a connection lost after a write was sent): running it again could
// repeat the effect.
func IsFinal(err error) bool {
	if errors.As(err, new(finalError)) {
		return true
	}
	s, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch s.Code() {
	case codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.OutOfRange,
		codes.Unimplemented, codes.Internal, codes.Unknown, codes.DataLoss, codes.InvalidArgument:
		return true
	}
	return false
}

// String describes r for a log line: never the message's id or body.
func (r Result) String() string {
	if r.Action == Nak {
		return fmt.Sprintf("%s (%s after %s)", r.Outcome, r.Action, r.Delay.Round(time.Millisecond))
	}
	return fmt.Sprintf("%s (%s)", r.Outcome, r.Action)
}

// Logger is the engine's logger (engine.WithLogger).
func (c *Consumer) Logger() *slog.Logger { return c.eng.Logger() }

// DeadLetter hands a Result that asks for it (Result.DeadLetter) to the
// adapter's dead-letter hook, if there is one, with the reason: a hook that
// fails turns the action into Nak, so that the redelivery tries it again.
func (c *Consumer) DeadLetter(ctx context.Context, res Result, hook func(ctx context.Context, err error) error) Result {
	if !res.DeadLetter || hook == nil {
		return res
	}
	if err := hook(ctx, res.Err); err != nil {
		c.Warn(ctx, "the dead-letter hook failed; the message is redelivered", ownError(err))
		res.Action = Nak
	}
	return res
}

// ownError is err, if it is this package's own, whose words hold nothing of
// a message's; or else a stand-in that names only its type, since a
// handler's, a hook's or an adapter function's error may quote the
// message's id, tenant or body.
func ownError(err error) error {
	for _, own := range []error{ErrNoID, ErrInvalidID, ErrReusedID, ErrFailedBefore, ErrLastDelivery, store.ErrFull} {
		if errors.Is(err, own) {
			return own
		}
	}
	return fmt.Errorf("an error of type %T (its words are not logged: they may quote the message)", err)
}

// Warn logs a failure of the adapter's, such as an acknowledgement that did
// not reach the broker, at Warn level with the consumer's name. err must not
// hold a message's id, tenant or body.
func (c *Consumer) Warn(ctx context.Context, msg string, err error) {
	c.eng.Logger().LogAttrs(ctx, slog.LevelWarn, "idemkey: "+msg,
		slog.String("operation", c.Name()), slog.Any("error", err))
}

// MaxBackoff is the longest delay a negative acknowledgement asks for
// (WithBackoff): with it, an adapter bounds how long a broker that counts
// deliveries may keep redelivering.
func (c *Consumer) MaxBackoff() time.Duration { return c.opts.maxBackoff }
