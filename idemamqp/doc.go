// Package idemamqp is the RabbitMQ Broker of package consumer, over AMQP
// 0-9-1 with github.com/rabbitmq/amqp091-go: New reads a queue's
// deliveries, and consumer.New processes each message once per id (see
// package consumer for the guarantees, and its two-phase exceptions).
//
// The key is the message's AMQP message-id property, which its producer sets
// once and keeps across its own retries (MessageID; CloudEventsID for a
// CloudEvent: consumer.WithMessageID(idemamqp.CloudEventsID)), scoped by the
// consumer's name. The timestamp property, if the publisher sets it, is
// when the message was sent (consumer.Delivery.Sent).
//
//	args := amqp.Table{"x-message-ttl": int64((24 * time.Hour).Milliseconds())}
//	_, err := ch.QueueDeclare("invoices", true, false, false, false, args)
//	b, err := idemamqp.New("invoices", args) // the args it was declared with
//	c, err := consumer.New(eng, "billing", b, func(ctx context.Context, d amqp.Delivery) error {
//		return bill(ctx, d.Body)
//	}, consumer.WithDeadLetter(keep)) // or consumer.WithDiscardDeadLetters()
//	deliveries, err := ch.Consume("invoices", "", false, false, false, false, nil) // autoAck false
//	for d := range deliveries { // in several workers, on a prefetch (ch.Qos) of as many
//		c.Handle(ctx, d) // runs, dead-letters and settles: ack, nack with requeue or reject
//	}
//
// For batches, NextBatch takes one from a worker's prefetch, and
// c.HandleBatch processes it together and settles it.
//
// NewPublisher is the other side, for package outbox's Relay: it publishes
// each message mandatory and persistent, with its Destination as the
// routing key and its ID as the message-id property that New's consumers
// read as the key, and counts it sent only once the broker confirmed it
// without returning it as unroutable.
//
// # RabbitMQ's caveats
//
//   - RabbitMQ has no delayed negative acknowledgement: the Broker's Settle
//     holds the worker, and the message a prefetch slot, for the delay
//     before it requeues it (at most a second for a message in progress
//     elsewhere, on a queue without a delivery limit). Run several workers.
//   - A quorum queue counts deliveries: with its x-delivery-limit, passed in
//     args, the last delivery is known, and a message that still fails goes
//     to the dead-letter hook and is acknowledged rather than dropped. A
//     classic queue never tells a message's attempt, so its backoff does not
//     grow, and it has no last delivery.
//   - AMQP cannot read a queue's arguments back: pass New the args the queue
//     was declared with. consumer.New checks its x-message-ttl against the
//     retention, and refuses a queue without one (consumer.WithHorizonWarning
//     accepts it). A TTL set by a policy is invisible: pass it in args.
//   - A refused message (no id, an id first used with another body) is
//     rejected without requeue: a queue's x-dead-letter-exchange
//     dead-letters it, besides the hook.
//
// docs/consumers.md has the rest: batches in detail, the last delivery of a
// message in progress elsewhere, and the redelivery horizon.
package idemamqp
