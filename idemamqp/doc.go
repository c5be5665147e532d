// Package idemamqp processes the messages of a RabbitMQ queue once per
// message id (see package consumer for the two-phase exceptions), over AMQP 0-9-1 with github.com/rabbitmq/amqp091-go: a
// thin adapter of the broker-neutral consumer package, which decides, and of
// the idemkey store under it, which remembers.
//
// The key is the message's AMQP message-id property, which its producer sets
// once and keeps across its own retries (MessageID; CloudEventsID for a
// CloudEvent; WithMessageID for another), scoped by the consumer's name. A message
// already processed is acknowledged without running the handler; one in
// progress on another worker is requeued after a delay; a handler's
// transient error releases the id and requeues the message after a backoff;
// its final error is recorded, acknowledged and handed to the dead-letter
// hook. A message whose timestamp property (set by its publisher) is older
// than the retention, and whose id has no record, is rejected and handed to
// the hook with consumer.ErrExpired, never run (consumer.Delivery.Sent).
//
// # Example
//
//	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention))
//	if err != nil { ... }
//	core, err := consumer.New(eng, "billing", consumer.WithSystem("rabbitmq"))
//	if err != nil { ... }
//	// Keep ids longer than the queue keeps its messages: a day, within the week.
//	args := amqp.Table{"x-message-ttl": int64((24 * time.Hour).Milliseconds())}
//	if _, err := ch.QueueDeclare("invoices", true, false, false, false, args); err != nil { ... }
//	c, err := idemamqp.New(core, "invoices", args, func(ctx context.Context, d amqp.Delivery) error {
//		return bill(ctx, d.Body)
//	}, idemamqp.WithDeadLetter(func(ctx context.Context, d amqp.Delivery, err error) error {
//		return keepDeadLetter(ctx, d.Body, consumer.Cause(err)) // required, or consumer.WithDiscardDeadLetters
//	}))
//	if err != nil { ... }
//	const workers = 8
//	if err := ch.Qos(workers, 0, false); err != nil { ... }
//	deliveries, err := ch.Consume("invoices", "", false, false, false, false, nil)
//	if err != nil { ... }
//	var wg sync.WaitGroup
//	for range workers {
//		wg.Go(func() {
//			for d := range deliveries {
//				c.Handle(ctx, d)
//			}
//		})
//	}
//	wg.Wait() // until the channel closes
//
// # Batches
//
// NextBatch takes a batch from a worker's prefetch, and HandleBatch
// processes it (consumer.Consumer.ProcessBatch) and acknowledges each
// message after the batch's commit; docs/consumers.md has the details.
//
// # Guarantees
//
//   - A message id's handler runs to success or final failure once while
//     its record is kept (the engine's retention, engine.WithRetention): a
//     redelivery, or the same message published again, is acknowledged
//     without running it, even on another worker, channel or process that
//     shares the store.
//   - With consumer.WithAtomic on a store that supports it (store/postgres),
//     the handler's writes through postgres.TxFromContext commit with the
//     message's record, or not at all: each message has exactly one effect,
//     whatever dies when.
//   - A message without an id, or whose id was first used with another body,
//     never runs: it is rejected without requeueing, so that a queue with an
//     x-dead-letter-exchange dead-letters it.
//   - A message that failed for good is recorded and acknowledged; every
//     delivery of it goes to the WithDeadLetter hook, a redelivery too, so
//     that the dead letter is sent at least once.
//   - New refuses a queue whose messages may be redelivered after their
//     record expires: one without an x-message-ttl, or with one longer
//     than the retention, unless core has consumer.WithHorizonWarning.
//   - The hooks of core's engine (engine.WithHooks) run once per delivery,
//     before Handle acknowledges it: one execution per message id, then a
//     replay per redelivery or publish again.
//
// # Caveats
//
//   - Without consumer.WithAtomic, a worker that dies after the handler's
//     effects and before the record leaves the id in progress until its
//     lease ends (engine.WithLease, consumer.WithHandlerTimeout); the
//     redelivery then runs the handler again.
//   - Consume with autoAck false. A delivery of an autoAck consumer was
//     acknowledged before Handle saw it, so that a failure loses it, and
//     Handle's acknowledgement closes the channel with an error.
//   - RabbitMQ cannot delay a negative acknowledgement: Handle waits the
//     delay out itself, holding the worker and a prefetch slot, before it
//     requeues the message. Run several workers with a prefetch of at least
//     as many; with one worker and a prefetch of one, a message in progress
//     elsewhere holds up the queue for the delay. That delay is a second on
//     a queue without a delivery limit, and on a quorum queue with an
//     x-delivery-limit the rest of the other run's lease, so as to spend
//     few deliveries.
//   - A requeued message goes back into the queue; a classic queue marks its
//     redelivery but does not count it, so that its backoff does not grow. A
//     quorum queue counts deliveries (x-delivery-count), and on the last
//     delivery its x-delivery-limit allows, passed to New in args, a
//     message that keeps failing goes to the dead-letter hook and is
//     acknowledged, rather than dropped by RabbitMQ. A last delivery that
//     finds its message in progress elsewhere (a run whose channel closed
//     under it, so that RabbitMQ requeued the message) waits in Handle for
//     that run to end, holding its worker (at most the run's lease, and at
//     most consumer.WithHandlerTimeout), and takes the message over if
//     the run released it (see package consumer).
//   - AMQP shows neither a queue's arguments nor its policies: New trusts
//     the args it is given. A TTL that a policy sets is not seen; pass it in
//     args, or use consumer.WithHorizonWarning.
//   - The TTL bounds how long a message stays in the queue, not how long a
//     producer may publish the same id again: that must stay within the
//     retention too.
package idemamqp
