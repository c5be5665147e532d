package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/store"
)

// Handler processes one message. In atomic mode ctx carries the store's
// transaction (see consumer.WithAtomic); its error decides what becomes of
// the message (consumer.Handler).
type Handler func(ctx context.Context, d amqp.Delivery) error

// Consumer processes the messages of one RabbitMQ queue with a Handler, at
// most once per message id, and acknowledges each as its outcome says.
type Consumer struct {
	core          *consumer.Consumer
	h             Handler
	opts          *options
	deliveryLimit int64 // a quorum queue's x-delivery-limit; -1: none
}

// New returns a Consumer that runs h for the messages of queue, with the
// idempotency of core. args are the arguments the queue was declared with,
// which AMQP cannot read back: New refuses (a *consumer.HorizonError) when
// core's records would expire while RabbitMQ may still redeliver a message
// (for up to the queue's x-message-ttl; without one, for as long as it
// takes), unless core was built with consumer.WithHorizonWarning, and
// refuses an x-message-ttl that is not a non-negative integer. A TTL set by
// a policy is not visible over AMQP: pass it in args as x-message-ttl, or
// build core with consumer.WithHorizonWarning.
//
// It starts nothing: call Handle for each delivery of a Consume with
// autoAck false.
func New(core *consumer.Consumer, queue string, args amqp.Table, h Handler, opts ...Option) (*Consumer, error) {
	if _, _, err := messageTTL(args); err != nil {
		return nil, fmt.Errorf("idemamqp: queue %q: %w", queue, err)
	}
	if err := core.CheckHorizon(context.Background(), redeliveryHorizon(queue, args)); err != nil {
		return nil, err
	}
	limit, ok := integer(args["x-delivery-limit"])
	if !ok || limit < 0 {
		limit = -1
	}
	o := newOptions(opts)
	if o.deadLetter == nil && !core.DiscardsDeadLetters() {
		return nil, errNoDeadLetter
	}
	return &Consumer{core: core, h: h, opts: o, deliveryLimit: limit}, nil
}

// errNoDeadLetter is New's answer to a consumer with nowhere to put a
// dead letter.
var errNoDeadLetter = errors.New("idemamqp: a message that fails for good, is refused, or fails for now on its last delivery has nowhere to go: " +
	"give WithDeadLetter a hook that keeps it (an exchange or a table of its own), " +
	"or build the consumer with consumer.WithDiscardDeadLetters() to acknowledge such messages and lose them, logged at Error level")

// deadLetter is the dead-letter hook for d; nil without one.
func (c *Consumer) deadLetter(d amqp.Delivery) func(context.Context, error) error {
	if c.opts.deadLetter == nil {
		return nil
	}
	return func(ctx context.Context, err error) error { return c.opts.deadLetter(ctx, d, err) }
}

// redeliveryHorizon is how long RabbitMQ may redeliver a message of queue, declared
// with args: at most its x-message-ttl, after which the message is gone,
// however often it was requeued (a requeued message keeps its expiry).
// Unbounded without one: RabbitMQ keeps an unacknowledged message, and
// redelivers it, for as long as it takes; a quorum queue's x-delivery-limit
// does not bound it either, since a requeued message waits for a consumer
// for as long as none takes it. A malformed x-message-ttl counts as none
// (New refuses it).
//
// A TTL set by a policy, rather than by the queue's arguments, is not
// visible over AMQP: with such a policy, pass its TTL in args as
// x-message-ttl, or build core with consumer.WithHorizonWarning.
func redeliveryHorizon(queue string, args amqp.Table) consumer.Horizon {
	ttl, ok, err := messageTTL(args)
	switch {
	case err != nil:
		return consumer.Horizon{Unbounded: true, Source: fmt.Sprintf("queue %s: %v", queue, err), Fix: fix(queue)}
	case !ok:
		return consumer.Horizon{Unbounded: true, Source: fmt.Sprintf("queue %s has no x-message-ttl", queue), Fix: fix(queue)}
	}
	return consumer.Horizon{Bound: ttl, Source: fmt.Sprintf("queue %s: x-message-ttl", queue), Fix: fix(queue)}
}

// fix says how to bound queue's horizon, for a HorizonError.
func fix(queue string) string {
	return fmt.Sprintf("declare queue %s with an x-message-ttl of at most the retention, in milliseconds, and pass it to New in args", queue)
}

// messageTTL reads args' x-message-ttl: ok is false when there is none.
// RabbitMQ takes any AMQP integer of milliseconds that is not negative, and
// refuses a queue with another (a float, a string).
func messageTTL(args amqp.Table) (ttl time.Duration, ok bool, err error) {
	v, ok := args["x-message-ttl"]
	if !ok {
		return 0, false, nil
	}
	ms, ok := integer(v)
	switch {
	case !ok:
		return 0, false, fmt.Errorf("x-message-ttl is a %T, not an integer of milliseconds", v)
	case ms < 0:
		return 0, false, errors.New("x-message-ttl is negative")
	case ms > math.MaxInt64/int64(time.Millisecond):
		return math.MaxInt64, true, nil
	}
	return time.Duration(ms) * time.Millisecond, true, nil
}

// integer returns v as an int64, if it holds an integer: a table field of
// amqp091's decoding, or of any Go integer type a caller declared it with.
func integer(v any) (int64, bool) {
	switch n := v.(type) {
	case int:
		return int64(n), true
	case int8:
		return int64(n), true
	case int16:
		return int64(n), true
	case int32:
		return int64(n), true
	case int64:
		return n, true
	case uint8:
		return int64(n), true
	case uint16:
		return int64(n), true
	case uint32:
		return int64(n), true
	case uint:
		return int64(min(uint64(n), math.MaxInt64)), true
	case uint64:
		return int64(min(n, math.MaxInt64)), true
	}
	return 0, false
}

// Handle processes d and acknowledges it as its outcome says: Process,
// then Settle. It returns the outcome, for a log line or a count.
func (c *Consumer) Handle(ctx context.Context, d amqp.Delivery) consumer.Result {
	res := c.Process(ctx, d)
	c.Settle(ctx, d, res)
	return res
}

// Process decides what becomes of d, running the handler unless its id was
// processed before or is in progress, without acknowledging it: Settle does. A message that ended
// in a final failure or was refused goes to the dead-letter hook
// (WithDeadLetter) here; if the hook fails, the Result's action is Nak.
func (c *Consumer) Process(ctx context.Context, d amqp.Delivery) consumer.Result {
	return c.core.DeadLetter(ctx, c.process(ctx, d), c.deadLetter(d))
}

// Settle tells RabbitMQ what Process decided for d: Ack, Nack with requeue,
// or Reject without requeue (which dead-letters it, if the queue has a
// dead-letter exchange). A failed acknowledgement is logged and left to
// RabbitMQ, which redelivers the message once its channel is closed; its
// redelivery is dropped as a duplicate.
//
// RabbitMQ has no delayed negative acknowledgement: to redeliver a message
// after Result.Delay, Settle waits for the delay (or until ctx is done) and
// then negative-acknowledges it. The wait holds the worker, and the message
// holds one of the channel's prefetch slots meanwhile, which is what spaces
// out the redeliveries of a failing message: run several workers, on a
// prefetch of at least as many, so that the others go on.
func (c *Consumer) Settle(ctx context.Context, d amqp.Delivery, res consumer.Result) {
	var err error
	switch res.Action {
	case consumer.Ack:
		err = d.Ack(false)
	case consumer.Reject:
		err = d.Reject(false)
	default:
		store.Pause(ctx, res.Delay) // the delay, unless ctx ends first or would within it
		err = d.Nack(false, true)
	}
	if err != nil {
		c.core.Warn(ctx, "acknowledging a message failed; RabbitMQ redelivers it once its channel is closed", err)
	}
}

func (c *Consumer) process(ctx context.Context, d amqp.Delivery) consumer.Result {
	cd, err := c.delivery(d)
	if err != nil {
		return c.core.Refuse(ctx, err)
	}
	return c.busy(c.core.Process(ctx, cd, func(ctx context.Context) error { return c.h(ctx, d) }))
}

// delivery reads d into a consumer.Delivery; an error refuses it.
func (c *Consumer) delivery(d amqp.Delivery) (consumer.Delivery, error) {
	id, err := c.opts.id(d)
	if err != nil {
		return consumer.Delivery{}, err
	}
	var tenant string
	if c.opts.tenant != nil {
		if tenant, err = c.opts.tenant(d); err != nil {
			return consumer.Delivery{}, err
		}
	}
	n := attempt(d.Headers)
	return consumer.Delivery{
		ID:          id,
		Tenant:      tenant,
		Body:        d.Body,
		Attempt:     n,
		Redelivered: d.Redelivered,
		Last:        c.deliveryLimit >= 0 && n-1 >= int(c.deliveryLimit),
		Sent:        d.Timestamp, // the publisher's, if it set one
	}, nil
}

// busy shortens the delay of a message in progress elsewhere, on a queue
// without a delivery limit.
func (c *Consumer) busy(res consumer.Result) consumer.Result {
	if res.Outcome == consumer.Busy && c.deliveryLimit < 0 {
		// Settle holds a worker for the delay. With no delivery limit to
		// spend, a message in progress elsewhere is requeued sooner than
		// the end of that run's lease.
		res.Delay = min(res.Delay, busyDelay)
	}
	return res
}

// busyDelay is the most a worker waits before it requeues a message in
// progress elsewhere, on a queue without a delivery limit.
const busyDelay = time.Second

// attempt counts a delivery from its x-delivery-count header, which a
// quorum queue sets on a redelivery to the number of earlier deliveries: 0,
// unknown, without it (on a first delivery, and always from a classic
// queue).
func attempt(h amqp.Table) int {
	n, ok := integer(h["x-delivery-count"])
	if !ok || n < 0 {
		return 0
	}
	return int(min(n, 1<<20)) + 1
}

// MessageID is the default id of a message: its AMQP message-id property.
func MessageID(d amqp.Delivery) (string, error) {
	if d.MessageId == "" {
		return "", fmt.Errorf("%w: no message-id property", consumer.ErrNoID)
	}
	return d.MessageId, nil
}

// CloudEventsID is the id of a CloudEvent in the AMQP binding's binary
// content mode: its cloudEvents:id application property, a header in AMQP
// 0-9-1, or cloudEvents_id, the binding's name for it where a colon is not
// allowed (WithMessageID(CloudEventsID)).
func CloudEventsID(d amqp.Delivery) (string, error) {
	var id string
	var found bool
	for _, name := range []string{"cloudEvents:id", "cloudEvents_id"} {
		v, ok := d.Headers[name]
		if !ok {
			continue
		}
		s, ok := v.(string)
		if !ok {
			return "", fmt.Errorf("idemamqp: the message's %s header is a %T, not a string", name, v)
		}
		if found && s != id {
			return "", errors.New("idemamqp: the message's cloudEvents:id and cloudEvents_id headers differ")
		}
		id, found = s, true
	}
	if !found {
		return "", fmt.Errorf("%w: no cloudEvents:id header", consumer.ErrNoID)
	}
	return id, nil
}
