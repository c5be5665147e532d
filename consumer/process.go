package consumer

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// handler is a core's handler of one delivery.
type handler = func(ctx context.Context) error

// The records of a processed message: what a redelivery finds.
var (
	recordProcessed = []byte("processed")
	recordFailed    = []byte("failed")
)

// The core's own errors in a Result. A record that does not open
// (errUnopened) never will: its last delivery is dead-lettered, not held.
var (
	errStillBusy        = errors.New("idemkey/consumer: the message was still in progress elsewhere")
	errStoreUnavailable = errors.New("idemkey/consumer: the store is unavailable")
	errUnopened         = errors.New("idemkey/consumer: the message's record does not open (engine.WithSealer)")
)

// process decides what becomes of d, running h unless its id was
// processed before or is in progress; a last delivery that met a failing
// store is held (hold).
func (c *core) process(ctx context.Context, d Delivery, h handler) Result {
	return c.hold(ctx, d, h, c.serve(ctx, d, h))
}

// hold tries d again after each backoff while it is held (a last delivery
// whose store fails), until the store answers or ctx ends.
func (c *core) hold(ctx context.Context, d Delivery, h handler, res Result) Result {
	if !held(d, res) {
		return res
	}
	c.warn(ctx, "the store failed on a message's last delivery; the delivery is held, and tried again until the store answers", ownError(res.Err))
	for attempt := max(d.Attempt, 1); held(d, res); attempt++ {
		if !store.Pause(ctx, c.backoff(attempt)) {
			c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: the consumer stopped while a message's last delivery waited for the store; "+
				"it is negative-acknowledged, neither run nor dead-lettered, and the broker may not deliver it again",
				slog.String("operation", c.op.Name()), slog.Any("error", ownError(res.Err)))
			break
		}
		res = c.serve(ctx, d, h)
	}
	return res
}

// held reports whether res is a last delivery's whose store failed.
func held(d Delivery, res Result) bool {
	return d.Last && res.Outcome == StoreFailed && res.Action == Nak
}

// serve is what one try of d, with h, decides.
func (c *core) serve(ctx context.Context, d Delivery, h handler) Result {
	x := &exchange{c: c, d: d, h: h}
	c.eng.Serve(ctx, c.op, x)
	return x.res
}

// exchange is one delivery, as engine.Serve reads and answers it.
type exchange struct {
	c *core
	d Delivery
	h handler
	// refused, if set, refuses the delivery before its id is looked up: the
	// message could not be read.
	refused error

	res Result
}

// Key is the message's id. An unread message says it has one, so that
// Fingerprint refuses it (engine.Refused), rather than a malformed key.
func (x *exchange) Key() (string, bool, error) {
	switch id := x.d.ID; {
	case x.refused != nil:
		return "", true, nil
	case id == "":
		return "", false, nil // KeyMissing: answered with ErrNoID
	case len(id) > idemkey.MaxKeyLen:
		return "", false, ErrInvalidID
	default:
		return id, true, nil
	}
}

// FirstSent is when the broker says the message was first published; none
// if that is in the future (a publisher's clock that runs ahead).
func (x *exchange) FirstSent() []string {
	if sent := x.d.Sent; !sent.IsZero() && !sent.After(time.Now()) {
		return []string{idemkey.FormatDate(sent)}
	}
	return nil
}

// FirstRegion is none: a message has no region it was first sent to.
func (x *exchange) FirstRegion() []string { return nil }

// Tenant is the message's tenant (engine.OperationSpec.OwnTenant).
func (x *exchange) Tenant() string { return x.d.Tenant }

func (x *exchange) Attempt() engine.Attempt {
	return engine.Attempt{Retried: x.d.Redelivered, Last: x.d.Last}
}

func (x *exchange) Fingerprint(context.Context) (store.Fingerprint, error) {
	if x.refused != nil {
		return store.Fingerprint{}, x.refused
	}
	return sha256.Sum256(x.d.Body), nil
}

func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	var out engine.HandlerResult
	x.res, out = x.c.ran(x.d, x.c.run(ctx, x.h))
	return out
}

// run runs h, and turns a panic into a transient ErrPanicked that names
// only the panic value's type: the value may quote the message.
func (c *core) run(ctx context.Context, h handler) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("%w: a panic of type %T", ErrPanicked, v)
			c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a message's handler panicked; its id is released, and it fails for now",
				slog.String("operation", c.op.Name()), slog.Any("error", err))
		}
	}()
	return h(ctx)
}

// StandIn is the record of a result the store had no room for: its own in
// two-phase mode, whose effects stand; "failed" in atomic mode, where they
// are undone.
func (x *exchange) StandIn(error) []byte {
	if x.c.op.Atomic() || x.res.Outcome != Processed {
		return recordFailed
	}
	return recordProcessed
}

// Pass would run the handler unprotected; a consumer never does.
func (x *exchange) Pass(ctx context.Context) int {
	return x.Answer(ctx, engine.Answer{Verdict: engine.StoreUnavailable})
}

func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	x.res = x.c.lastDelivery(x.d, x.c.answer(ctx, x.d, a, x.res))
	return int(x.res.Action)
}

// ran is the Result of a run that returned err, and what to record of it.
func (c *core) ran(d Delivery, err error) (Result, engine.HandlerResult) {
	switch {
	case err != nil && !c.opts.final(err):
		return Result{Outcome: Retry, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}, engine.HandlerResult{Release: true}
	case err != nil:
		return Result{Outcome: Failed, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: err}, engine.HandlerResult{Record: recordFailed}
	}
	return Result{Outcome: Processed, Action: Ack}, engine.HandlerResult{Record: recordProcessed, KeepWrites: true}
}

// answer is the Result of d that a says; ran is the handler's, for
// Executed.
func (c *core) answer(ctx context.Context, d Delivery, a engine.Answer, ran Result) Result {
	switch a.Verdict {
	case engine.Executed:
		if a.StandIn == nil {
			return ran
		}
		if c.op.Atomic() {
			// Its writes were undone, and it is recorded as failed.
			return Result{Outcome: Failed, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: a.StandIn}
		}
		// Its effects happened: acknowledging keeps them to one, and the id
		// stays in progress until its lease ends.
		c.warn(ctx, "no room to record a processed message; it is acknowledged all the same", a.StandIn)
		return ran
	case engine.Replayed:
		if string(a.Outcome) == string(recordFailed) {
			return Result{Outcome: Duplicate, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: ErrFailedBefore}
		}
		return Result{Outcome: Duplicate, Action: Ack}
	case engine.InProgress:
		res := Result{Outcome: Busy, Action: Nak, Delay: a.RetryAfter}
		if d.Last { // it waited, for as long as the engine lets it
			res.Err = errStillBusy
			if err := ctx.Err(); err != nil {
				res.Err = fmt.Errorf("%w: %w", errStillBusy, err)
			}
		}
		return res
	case engine.KeyMissing:
		return c.refuse(ctx, ErrNoID)
	case engine.Reused:
		return c.refuse(ctx, ErrReusedID)
	case engine.Expired:
		// Its age and the retention it outlived tell an operator why: a
		// message moved back by hand from a dead-letter queue, say.
		return c.refuse(ctx, ErrExpired, slog.Duration("age", time.Since(d.Sent).Round(time.Second)),
			slog.Duration("retention", c.op.Retention()))
	case engine.KeyInvalid, engine.Refused, engine.FirstSentInvalid:
		return c.refuse(ctx, a.Err)
	case engine.StoreFull:
		return Result{Outcome: StoreFailed, Action: Nak, Delay: c.backoff(d.Attempt), Err: store.ErrFull}
	case engine.OutcomeUnknown:
		// Held: each delivery asks the step's reconcile again; the last is
		// dead-lettered.
		return Result{Outcome: Retry, Action: Nak, Delay: c.backoff(d.Attempt), Err: engine.ErrOutcomeUnknown}
	}
	// StoreFailed; a consumer never fails open.
	err := ctx.Err()
	switch {
	case err != nil:
	case a.Unopened:
		err = errUnopened
	default:
		err = errStoreUnavailable
	}
	return Result{Outcome: StoreFailed, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}
}

// lastDelivery dead-letters and acknowledges res, d's Result, if d is a last
// delivery that res would have delivered again, but for a failing store's
// (process holds those).
func (c *core) lastDelivery(d Delivery, res Result) Result {
	if !d.Last || res.Action != Nak || res.Outcome == StoreFailed && !errors.Is(res.Err, errUnopened) {
		return res
	}
	res.Action, res.DeadLetter = Ack, true
	res.Err = fmt.Errorf("%w: %w", ErrLastDelivery, res.Err)
	return res
}

// refused is the Result of a message whose delivery could not be read
// (err says why), counted, logged and handed to the hooks like the
// engine's refusals.
func (c *core) refused(ctx context.Context, err error) Result {
	x := &exchange{c: c, refused: err}
	c.eng.Serve(ctx, c.op, x)
	return x.res
}

// refuse is the Result of a message refused for err, which it logs with
// attrs.
func (c *core) refuse(ctx context.Context, err error, attrs ...slog.Attr) Result {
	attrs = append([]slog.Attr{slog.String("operation", c.op.Name())}, attrs...)
	c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: message refused; it is terminated, or dead-lettered, without running",
		append(attrs, slog.Any("error", ownError(err)))...)
	return Result{Outcome: Rejected, Action: Reject, DeadLetter: true, Delay: c.backoff(1), Err: err}
}

// backoff is the delay before the attempt-th delivery's next one
// (WithBackoff); the random part spreads out messages that failed together.
func (c *core) backoff(attempt int) time.Duration {
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

// deadWhy says why res, a Result to dead-letter, is one.
func deadWhy(res Result) string {
	switch {
	case res.Outcome == Busy:
		return "was still in progress elsewhere when its last delivery stopped waiting"
	case errors.Is(res.Err, ErrLastDelivery):
		return "failed for now on its last delivery"
	case res.Outcome == Rejected:
		return "was refused"
	}
	return "failed for good"
}

// warn logs a failure of the broker's (err holds no message's id, tenant
// or body) at Warn level.
func (c *core) warn(ctx context.Context, msg string, err error) {
	c.eng.Logger().LogAttrs(ctx, slog.LevelWarn, "idemkey: "+msg,
		slog.String("operation", c.op.Name()), slog.Any("error", err))
}
