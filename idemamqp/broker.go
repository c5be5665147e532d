package idemamqp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/store"
)

// New returns the Broker of queue, declared with args, for consumer.New:
//
//	b, err := idemamqp.New("billing", args)
//	c, err := consumer.New(eng, "billing", b, handle, consumer.WithDeadLetter(keep))
//	for d := range deliveries { c.Handle(ctx, d) } // a Consume's, autoAck false
//
// AMQP cannot read a queue's arguments back: pass those it was declared
// with. The Broker's horizon, which consumer.New checks against the
// retention, is the queue's x-message-ttl; without one, for as long as
// RabbitMQ keeps an unacknowledged message. A TTL set by a policy is not
// visible over AMQP: pass it in args as x-message-ttl, or build the
// consumer with consumer.WithHorizonWarning. New refuses an x-message-ttl
// that is not a non-negative integer.
func New(queue string, args amqp.Table) (consumer.Broker[amqp.Delivery], error) {
	if _, _, err := messageTTL(args); err != nil {
		return nil, fmt.Errorf("idemamqp: queue %q: %w", queue, err)
	}
	limit, ok := integer(args["x-delivery-limit"])
	if !ok || limit < 0 {
		limit = -1
	}
	return &broker{queue: queue, args: args, deliveryLimit: limit}, nil
}

// broker is a RabbitMQ queue's consumer.Broker.
type broker struct {
	queue         string
	args          amqp.Table
	deliveryLimit int64 // a quorum queue's x-delivery-limit; -1: none
}

func (*broker) System() string { return "rabbitmq" }

func (*broker) ID(d amqp.Delivery) (string, error) { return MessageID(d) }

func (b *broker) Read(d amqp.Delivery) (consumer.Delivery, error) {
	n := attempt(d.Headers)
	if b.deliveryLimit >= 0 {
		n = max(n, 1) // a quorum queue's first delivery has no count
	}
	return consumer.Delivery{
		Body:        d.Body,
		Attempt:     n,
		Redelivered: d.Redelivered,
		Last:        b.deliveryLimit >= 0 && n-1 >= int(b.deliveryLimit),
		Sent:        d.Timestamp, // the publisher's, if it set one
	}, nil
}

func (b *broker) Horizons(time.Duration) []consumer.Horizon {
	return []consumer.Horizon{redeliveryHorizon(b.queue, b.args)}
}

// Settle acknowledges and rejects (without requeueing, which a queue with
// an x-dead-letter-exchange dead-letters) at once, then negative-acknowledges
// each of the others with requeue once its Result.Delay has passed, or ctx
// is done, the shortest first. RabbitMQ has no delayed negative
// acknowledgement: Settle holds the worker, and the message a prefetch
// slot, for the delay, which is what spaces out a failing message's
// redeliveries; run several workers, on a prefetch of at least as many. A
// lost acknowledgement is redelivered once the channel closes.
func (b *broker) Settle(ctx context.Context, ds []amqp.Delivery, results []consumer.Result) error {
	var errs []error
	var later []int
	for i, d := range ds {
		switch results[i].Action {
		case consumer.Ack:
			errs = append(errs, d.Ack(false))
		case consumer.Reject:
			errs = append(errs, d.Reject(false))
		default:
			later = append(later, i)
		}
	}
	for _, i := range later {
		results[i].Delay = b.delay(results[i])
	}
	slices.SortStableFunc(later, func(i, j int) int { return cmp.Compare(results[i].Delay, results[j].Delay) })
	start := time.Now()
	for _, i := range later {
		store.Pause(ctx, results[i].Delay-time.Since(start)) // unless ctx ends first, or would within it
		errs = append(errs, ds[i].Nack(false, true))
	}
	return errors.Join(errs...)
}

// delay is how long a message is held before it is requeued: a message in
// progress elsewhere, on a queue with no delivery limit to spend, at most
// busyDelay, rather than until that run's lease ends.
func (b *broker) delay(res consumer.Result) time.Duration {
	if res.Outcome == consumer.Busy && b.deliveryLimit < 0 {
		return min(res.Delay, busyDelay)
	}
	return res.Delay
}

// busyDelay is the most a worker waits before it requeues a message in
// progress elsewhere, on a queue without a delivery limit.
const busyDelay = time.Second

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
// x-message-ttl, or build the consumer with consumer.WithHorizonWarning.
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
