package consumer

import (
	"context"
	"time"
)

// Broker is the seam between a Consumer and one broker's messages, of type M
// (jetstream.Msg, amqp.Delivery, *kgo.Record): idemnats, idemamqp and
// idemkafka each build one. A new broker is a Broker and a run of the broker
// suite (tests/brokertest). A Broker never runs a handler, logs, or
// dead-letters: the Consumer does.
//
// Two methods are optional, for what only one broker needs:
//   - MaxAttempts() int: the broker cannot deliver one message again on its
//     own (Kafka, whose offsets move past a record or not at all). A message
//     that fails for now is then tried again in process, after each backoff,
//     up to that many times, the last try counting as its last delivery; the
//     Consumer sets Delivery.Attempt, Redelivered and Last.
//   - CheckTenantIDs(id any) error: the broker drops a message whose own id
//     it has seen, whichever the tenant (JetStream's duplicate window). New
//     calls it when WithMessageTenant is given, with WithMessageID's
//     function (nil for the broker's ID); an error refuses the consumer.
//
// A wrapper of a Broker that embeds it hides these two: it must pass them on.
type Broker[M any] interface {
	// System names the broker in the metrics' messaging.system attribute
	// (OpenTelemetry's names: "nats", "rabbitmq", "kafka").
	System() string
	// ID reads m's id as its producer set it; WithMessageID replaces it. An
	// error refuses m.
	ID(m M) (string, error)
	// Read reads the rest of m's delivery: all of Delivery but ID and
	// Tenant. An error refuses m. Neither Read's errors nor ID's quote m.
	Read(m M) (Delivery, error)
	// Settle tells the broker what became of ms, results[i] of ms[i]: Ack,
	// Nak after Result.Delay, or Reject. It may lower a Nak's Delay to the
	// one it used. Its error is logged: the broker delivers an unsettled
	// message again, and it is dropped as a duplicate.
	Settle(ctx context.Context, ms []M, results []Result) error
	// Horizons says, from the broker's settings, how long after a message is
	// first processed the broker may deliver it again; New refuses a
	// consumer whose records would expire sooner. maxBackoff is the longest
	// delay a Nak asks for (WithBackoff).
	Horizons(maxBackoff time.Duration) []Horizon
}

// Delivery is what a Broker read of one delivery of a message.
type Delivery struct {
	// ID is the message's id: the key. Empty refuses the message (ErrNoID).
	ID string
	// Tenant scopes the id (WithMessageTenant).
	Tenant string
	// Body is fingerprinted: an id first seen with another body is refused.
	Body []byte
	// Attempt counts the message's deliveries from 1, where the broker tells
	// it; 0 when it does not. It sets the backoff.
	Attempt int
	// Redelivered marks a later delivery: its record is read first.
	Redelivered bool
	// Last is true when the message will not be delivered again (JetStream's
	// max deliver, a quorum queue's delivery limit, Kafka's last attempt).
	Last bool
	// Sent is when the message was first published, as the broker tells it,
	// or zero. A message sent before the retention whose id has no record is
	// refused (ErrExpired); a Sent in the future counts as unknown.
	Sent time.Time
	// Skip, set by Read, passes the message over unrun: its Result is Retry
	// and Nak, with Skip as Err, and the broker delivers it again (a Kafka
	// record after one its partition was set back to).
	Skip error
}
