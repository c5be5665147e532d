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

// New returns a Consumer named name on eng, the engine that holds the
// settings every entry point shares (engine.New: the store, the retention,
// leases, sealing, logging, hooks, metrics); opts are the consumer's own.
// Give eng a retention that outlives the broker's redeliveries
// (engine.WithRetention(RecommendedRetention)): the adapters check it. The
// name scopes the message ids, so two consumers of one stream each process
// every message once; it names the consumer in metrics and logs too.
//
// The tenant of a message is the adapter's (Delivery.Tenant), so eng needs
// neither engine.WithTenant nor engine.WithSingleTenant, and a consumer
// never reads them; nor engine.WithKeyRequired (an id is always required)
// or engine.WithInProgressWait (a message in progress elsewhere is
// negative-acknowledged at once, until that run's lease ends, whatever
// engine.WithMaxRetryAfter says; its last delivery waits instead). A
// consumer never runs a handler unprotected: on an engine with
// engine.WithFailOpen its store failures are still answered
// StoreFailed (counted failed_open).
//
// It returns an error for a nil eng, an empty name, WithAtomic on a store
// that does not implement store.Atomic, or a WithHandlerTimeout longer than
// the engine's longest lease allows (engine.WithMaxLease, less five
// seconds).
func New(eng *engine.Engine, name string, opts ...Option) (*Consumer, error) {
	if eng == nil {
		return nil, errors.New("idemkey/consumer: New needs an engine: engine.New(store, engine.WithRetention(consumer.RecommendedRetention))")
	}
	if name == "" {
		return nil, errors.New("idemkey/consumer: the consumer needs a name, which scopes its message ids")
	}
	o := newOptions(opts)
	op, err := eng.Operation(engine.OperationSpec{
		Name:   name,
		Atomic: o.atomic,
		Metrics: engine.MetricsSpec{Attributes: []attribute.KeyValue{
			attribute.String("messaging.system", o.system),
			attribute.String("messaging.consumer.group.name", name),
		}, Status: actionAttribute},
		Tenant:         deliveryTenant,
		KeyRequired:    true,
		Redelivers:     true,
		HandlerTimeout: o.handlerTimeout,
	})
	if err != nil {
		return nil, err
	}
	return &Consumer{eng: eng, op: op, opts: o}, nil
}

// deliveryTenant is the tenant of the delivery that x, one of the
// consumer's exchanges, carries ("" for a refusal, which has none).
func deliveryTenant(x engine.Exchange) string { return x.(*exchange).d.Tenant }

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
	// Last is true when the message will not be delivered again
	// (JetStream's max deliver, a quorum queue's delivery limit, the Kafka
	// adapter's last attempt): a message that failed for now is
	// dead-lettered instead, and acknowledged; one in progress elsewhere is
	// waited for, and one whose store fails is held until it answers.
	Last bool
	// Sent is when the message was first published, as the broker tells it
	// (JetStream's stored time, AMQP's timestamp property), or zero. A
	// message sent longer ago than the retention (less engine.WithClockSkew)
	// whose id has no record is refused with ErrExpired, not processed:
	// its record may have been there, and expired. A Sent in the future
	// counts as unknown: a publisher's clock that runs ahead refuses
	// nothing.
	Sent time.Time
}

// Handler processes one message. In atomic mode ctx carries the store's
// transaction: its writes commit with the message's record.
//
// Its error decides what becomes of the message (see WithClassifier): by
// default a gRPC status with a code the gRPC interceptor records, or an
// error wrapped with Final, is a final failure (recorded, acknowledged, dead
// letter); any other error is transient (the key is released and the message
// redelivered after a backoff), and so is a panic (ErrPanicked), which the
// consumer recovers from and logs with the panic value's type only.
type Handler func(ctx context.Context) error

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
	// or a Duplicate of a message that failed), was Rejected, or, on its last
	// delivery, failed for now or was still in progress elsewhere when the
	// delivery stopped waiting: the adapter hands it to its dead-letter hook
	// before it acts, and on the hook's error negative-acknowledges it
	// instead, with Delay. So a dead letter is sent at least once, even by a
	// redelivery of a message whose failure was recorded, as long as the
	// broker redelivers: a hook that fails on the last delivery loses it.
	DeadLetter bool
	// Err says why, for Failed, Retry, Rejected, the store's outcomes and a
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
	// on its last delivery (Delivery.Last): it is dead-lettered instead. Its
	// words hold on every broker: the broker's own limit (JetStream, RabbitMQ)
	// or the adapter's (Kafka's attempts) ends its deliveries.
	ErrLastDelivery = errors.New("idemkey/consumer: the message's last delivery did not process it")
	// ErrPanicked is the error of a handler that panicked, with the panic
	// value's type: a transient failure (see Handler).
	ErrPanicked = errors.New("idemkey/consumer: the handler panicked")
)

// Records of a processed message: what a redelivery finds.
var (
	recordProcessed = []byte("processed")
	recordFailed    = []byte("failed")
)

// errStillBusy is why a last delivery that stopped waiting, with its message
// still in progress elsewhere, is dead-lettered.
var errStillBusy = errors.New("idemkey/consumer: the message was still in progress elsewhere")

// errStoreUnavailable is the Err of a StoreFailed Result whose context
// is not done.
var errStoreUnavailable = errors.New("idemkey/consumer: the store is unavailable")

// errUnopened is the Err of a StoreFailed Result whose message's record
// does not open (engine.Answer.Unopened): no redelivery will open it, so
// its last delivery is dead-lettered rather than held.
var errUnopened = errors.New("idemkey/consumer: the message's record does not open (engine.WithSealer)")

// Process decides what to do with one delivery, running h unless its id was
// processed before or is in progress, and returns what the adapter tells the
// broker. ctx bounds the store's operations and h; WithHandlerTimeout bounds
// h further, and sets its lease.
//
// On a message's last delivery (Delivery.Last), Process does not return
// while another run holds the id: it waits for that run to end, so as to
// take the message over; nor while the store fails: it tries again after
// each backoff until the store answers or ctx ends (see the package
// documentation).
func (c *Consumer) Process(ctx context.Context, d Delivery, h Handler) Result {
	return c.hold(ctx, d, h, c.serve(ctx, d, h))
}

// hold is res, d's Result, unless d is a last delivery that met a failing
// store (held): then d is tried again after each backoff until the store
// answers or ctx ends, and hold is the last try's Result.
func (c *Consumer) hold(ctx context.Context, d Delivery, h Handler, res Result) Result {
	if !held(d, res) {
		return res
	}
	c.Warn(ctx, "the store failed on a message's last delivery; the delivery is held, and tried again until the store answers", ownError(res.Err))
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

// held reports whether res, d's Result, is one that Process holds: the last
// delivery of a message whose store failed, to be redelivered (a record
// that does not open was dead-lettered by lastDelivery instead).
func held(d Delivery, res Result) bool {
	return d.Last && res.Outcome == StoreFailed && res.Action == Nak
}

// serve is what one try of d, with h, decides.
func (c *Consumer) serve(ctx context.Context, d Delivery, h Handler) Result {
	x := &exchange{c: c, d: d, h: h}
	c.eng.Serve(ctx, c.op, x)
	return x.res
}

// exchange is one delivery, as engine.Serve reads and answers it; res is
// its Result: the handler's, once Run has run it, then the answer's.
type exchange struct {
	c *Consumer
	d Delivery
	h Handler
	// refused, if set, refuses the delivery before its id is looked up
	// (Refuse): no message could be read.
	refused error

	res Result
}

// Key is the message's id. A refusal says it has one, so that Serve goes
// on to Fingerprint, which refuses it: its verdict is then engine.Refused (an
// adapter cannot read the message's tenant, or its id), not a malformed key.
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
// if it does not say, or says a time in the future (a publisher's clock
// that runs ahead refuses nothing).
func (x *exchange) FirstSent() []string {
	if sent := x.d.Sent; !sent.IsZero() && !sent.After(time.Now()) {
		return []string{idemkey.FormatDate(sent)}
	}
	return nil
}

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

// run runs h, and turns a panic into an ErrPanicked that names only the
// panic value's type: the value may quote the message. A handler that
// panics fails for now, as one that returns a plain error does: its id is
// released, its writes undone, and it is redelivered after a backoff
// (dead-lettered on its last delivery), while the consumer goes on.
func (c *Consumer) run(ctx context.Context, h Handler) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("%w: a panic of type %T", ErrPanicked, v)
			c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a message's handler panicked; its id is released, and it fails for now",
				slog.String("operation", c.op.Name()), slog.Any("error", err))
		}
	}()
	return h(ctx)
}

// StandIn is the record of a result the store had no room for
// (store.ErrFull: a consumer's records, a few bytes, are far below any
// engine.WithMaxRecordSize). In two-phase mode it is the result's own,
// whose effects stand; in atomic mode, where they are undone, "failed".
func (x *exchange) StandIn(error) []byte {
	if x.c.op.Atomic() || x.res.Outcome != Processed {
		return recordFailed
	}
	return recordProcessed
}

// Pass would run the handler unprotected; a consumer never does, not even
// on an engine with engine.WithFailOpen (nor can a message lack a key): the
// store failed, and the message is redelivered.
func (x *exchange) Pass(ctx context.Context) int {
	return x.Answer(ctx, engine.Answer{Verdict: engine.StoreUnavailable})
}

func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	x.res = x.c.lastDelivery(x.d, x.c.answer(ctx, x.d, a, x.res))
	return int(x.res.Action)
}

// ran is the Result of a run of the handler that returned err, and what to
// record of it: a transient error releases the id; a final one, or none,
// is recorded.
func (c *Consumer) ran(d Delivery, err error) (Result, engine.HandlerResult) {
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
func (c *Consumer) answer(ctx context.Context, d Delivery, a engine.Answer, ran Result) Result {
	switch a.Verdict {
	case engine.Executed:
		if a.StandIn == nil {
			return ran
		}
		if c.op.Atomic() {
			// Its writes were undone, and it is recorded as failed.
			return Result{Outcome: Failed, Action: Ack, DeadLetter: true, Delay: c.backoff(d.Attempt), Err: a.StandIn}
		}
		// The handler's effects happened and its record may not have been
		// written: acknowledging keeps them to one, and the id stays in
		// progress until its lease ends, so a duplicate meanwhile is
		// delayed.
		c.Warn(ctx, "no room to record a processed message; it is acknowledged all the same", a.StandIn)
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
			slog.Duration("retention", c.eng.Retention()))
	case engine.KeyInvalid, engine.Refused, engine.FirstSentInvalid:
		return c.refuse(ctx, a.Err)
	case engine.StoreFull:
		return Result{Outcome: StoreFailed, Action: Nak, Delay: c.backoff(d.Attempt), Err: store.ErrFull}
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

// lastDelivery is res, unless d is the message's last delivery and res
// would have it redelivered: a message that failed for now, was still in
// progress elsewhere when the engine stopped waiting for it, or whose record
// does not open. It is then dead-lettered and acknowledged: the broker would
// drop it. A store that failed is no reason to spend a last delivery:
// Process holds it and tries again, and its StoreFailed Result stays a Nak.
func (c *Consumer) lastDelivery(d Delivery, res Result) Result {
	if !d.Last || res.Action != Nak || res.Outcome == StoreFailed && !errors.Is(res.Err, errUnopened) {
		return res
	}
	res.Action, res.DeadLetter = Ack, true
	res.Err = fmt.Errorf("%w: %w", ErrLastDelivery, res.Err)
	return res
}

// Refuse is the Result of a message the adapter refuses before Process: its
// id or tenant could not be read (err says why). It is counted (verdict
// Rejected), logged and handed to the hooks like the refusals of Process.
func (c *Consumer) Refuse(ctx context.Context, err error) Result {
	x := &exchange{c: c, refused: err}
	c.eng.Serve(ctx, c.op, x)
	return x.res
}

// refuse is the Result of a message refused for err, which it logs with
// attrs.
func (c *Consumer) refuse(ctx context.Context, err error, attrs ...slog.Attr) Result {
	attrs = append([]slog.Attr{slog.String("operation", c.op.Name())}, attrs...)
	c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: message refused; it is terminated, or dead-lettered, without running",
		append(attrs, slog.Any("error", ownError(err)))...)
	return Result{Outcome: Rejected, Action: Reject, DeadLetter: true, Delay: c.backoff(1), Err: err}
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

// IsFinal is the default classification of a handler's error, the one
// every entry point shares (docs/answers.md): final when it is marked with
// Final, or is a gRPC status whose code the gRPC interceptor records
// (NotFound, AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented,
// Internal, Unknown, DataLoss); transient otherwise, including a plain
// error, which is what a failing dependency returns, and InvalidArgument,
// which the gRPC interceptor releases too: a handler that knows a message
// can never succeed (a body it cannot parse) says so with Final. Unknown
// counts only as an explicit status, for an effect whose outcome is unknown
// (a connection lost after a write was sent): running it again could repeat
// the effect.
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
		codes.Unimplemented, codes.Internal, codes.Unknown, codes.DataLoss:
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

// DeadLetter hands a Result that asks for it (Result.DeadLetter) to the
// adapter's dead-letter hook, with the reason: a hook that fails turns the
// action into Nak, so that the redelivery tries it again. With no hook (nil)
// the consumer must discard such messages (WithDiscardDeadLetters): each is
// logged at Error level as discarded, and its action stands. A message sent
// to the hook on its last delivery (ErrLastDelivery) is logged at Error
// level as dead-lettered.
func (c *Consumer) DeadLetter(ctx context.Context, res Result, hook func(ctx context.Context, err error) error) Result {
	if !res.DeadLetter {
		return res
	}
	if hook == nil {
		c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a message that "+deadWhy(res)+" is discarded, with no dead letter (consumer.WithDiscardDeadLetters)",
			slog.String("operation", c.op.Name()), slog.String("outcome", res.Outcome.String()), slog.Any("error", ownError(res.Err)))
		return res
	}
	if err := hook(ctx, res.Err); err != nil {
		c.Warn(ctx, "the dead-letter hook failed; the message is redelivered", ownError(err))
		res.Action = Nak
		return res
	}
	if errors.Is(res.Err, ErrLastDelivery) {
		c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a message that "+deadWhy(res)+" is dead-lettered",
			slog.String("operation", c.op.Name()), slog.String("outcome", res.Outcome.String()), slog.Any("error", ErrLastDelivery))
	}
	return res
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

// DiscardsDeadLetters reports whether the consumer was built with
// WithDiscardDeadLetters: an adapter's New refuses a consumer with no
// dead-letter hook without it.
func (c *Consumer) DiscardsDeadLetters() bool { return c.opts.discardDeadLetters }

// ownErrors are the errors a Result holds of this package's, and of the
// engine's, whose words hold nothing of a message's: every one a consumer
// answers with but the handler's.
var ownErrors = []error{ErrNoID, ErrInvalidID, ErrReusedID, ErrFailedBefore, ErrExpired, ErrLastDelivery,
	ErrPanicked, errStillBusy, errStoreUnavailable, errUnopened, store.ErrFull, store.ErrDataLost}

// ownError is err, if it is one of ownErrors or an engine.FirstSentError;
// or else a stand-in that names only a gRPC status's code, or the error's
// type (inside a Final), since a handler's, a hook's or an adapter
// function's words may quote the message's id, tenant or body.
func ownError(err error) error {
	for _, own := range ownErrors {
		if errors.Is(err, own) {
			return own
		}
	}
	if fse := new(engine.FirstSentError); errors.As(err, &fse) {
		return fse
	}
	if s, ok := status.FromError(err); ok && err != nil {
		return errors.New("the handler's gRPC status " + s.Code().String())
	}
	if final := new(finalError); errors.As(err, final) {
		return fmt.Errorf("a final error (consumer.Final) of type %T (its words are left out: they may quote the message)", final.error)
	}
	return fmt.Errorf("an error of type %T (its words are left out: they may quote the message)", err)
}

// Cause says why a Result failed, for a dead letter or a log line that
// others read: the words of this package's errors (ErrLastDelivery's with
// the reason it wraps), a gRPC status's code, or else only the error's type;
// never the handler's own words, which may quote the message.
func Cause(err error) string {
	if err == nil {
		return ""
	}
	prefix := ""
	if errors.Is(err, ErrLastDelivery) {
		prefix = ErrLastDelivery.Error() + ": "
		if multi, ok := err.(interface{ Unwrap() []error }); ok && len(multi.Unwrap()) == 2 {
			err = multi.Unwrap()[1] // fmt.Errorf("%w: %w", ErrLastDelivery, why)
		}
	}
	return prefix + ownError(err).Error()
}

// Warn logs a failure of the adapter's, such as an acknowledgement that did
// not reach the broker, at Warn level with the consumer's name. err must not
// hold a message's id, tenant or body.
func (c *Consumer) Warn(ctx context.Context, msg string, err error) {
	c.eng.Logger().LogAttrs(ctx, slog.LevelWarn, "idemkey: "+msg,
		slog.String("operation", c.op.Name()), slog.Any("error", err))
}

// MaxBackoff is the longest delay a negative acknowledgement asks for
// (WithBackoff): with it, an adapter bounds how long a broker that counts
// deliveries may keep redelivering.
func (c *Consumer) MaxBackoff() time.Duration { return c.opts.maxBackoff }
