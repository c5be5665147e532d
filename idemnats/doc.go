// Package idemnats processes the messages of a NATS JetStream consumer at
// most once per message id, with github.com/nats-io/nats.go's jetstream
// package: a thin adapter of the broker-neutral consumer package, which
// decides, and of the idemkey store under it, which remembers.
//
// The key is the message's Nats-Msg-Id header, which JetStream itself uses
// to drop a producer's resends within the stream's duplicate window
// (MessageID; CloudEventsID for a CloudEvent; WithMessageID for another), scoped by
// the consumer's name. idemkey covers what that window does not: a resend
// after it, and every redelivery to the consumer. A message already
// processed is acknowledged without running the handler; one in progress on
// another worker is redelivered after a delay (NakWithDelay); a handler's
// transient error releases the id and redelivers the message after a
// backoff; its final error is recorded, acknowledged and handed to the
// dead-letter hook. A message the stream stored longer ago than the
// retention, whose id has no record, is terminated and handed to the hook
// with consumer.ErrExpired, never run (consumer.Delivery.Sent).
//
// # Message ids and tenants
//
// With WithMessageTenant, idemkey scopes an id by the tenant too, but
// JetStream does not: within the stream's duplicate window it drops a
// message whose Nats-Msg-Id it stored, whichever the tenant, and tells the
// producer Duplicate; no consumer sees it. A Nats-Msg-Id must therefore be
// unique across tenants: the producer puts the tenant in it
// ("acme/order-1001") and the consumer says so with
// WithMessageIDsUniqueAcrossTenants, or the tenant's own id travels in
// another header, which WithMessageID reads. Otherwise New refuses a tenant
// function with the default MessageID (a *DuplicateWindowError). The window
// cannot be turned off: a stream's Duplicates of 0 is JetStream's default,
// two minutes. Without a tenant function there is nothing to do: JetStream
// drops only ids that idemkey, which scopes them by a consumer of the stream,
// would drop too.
//
// # Example
//
//	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention))
//	if err != nil { ... }
//	core, err := consumer.New(eng, "billing", consumer.WithSystem("nats"), consumer.WithAtomic())
//	if err != nil { ... }
//	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
//		Name: "ORDERS", Subjects: []string{"orders.>"},
//		MaxAge: 72 * time.Hour, // within the seven days that ids are kept
//	})
//	if err != nil { ... }
//	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
//		Durable: "billing", AckPolicy: jetstream.AckExplicitPolicy,
//	})
//	if err != nil { ... }
//	c, err := idemnats.New(ctx, core, stream, cons, func(ctx context.Context, msg jetstream.Msg) error {
//		return bill(ctx, msg.Data()) // writes through postgres.TxFromContext(ctx)
//	}, idemnats.WithDeadLetter(func(ctx context.Context, msg jetstream.Msg, err error) error {
//		return keepDeadLetter(ctx, msg.Data(), consumer.Cause(err)) // required, or consumer.WithDiscardDeadLetters
//	}))
//	if err != nil { ... } // a *consumer.HorizonError, say
//	cc, err := cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
//
// # Batches
//
// NextBatch takes a batch from a Messages iterator, and HandleBatch
// processes it (consumer.Consumer.ProcessBatch: in atomic mode one round
// trip and one commit for the batch) and acknowledges each message after
// that commit; docs/consumers.md has the details.
//
// # Guarantees
//
//   - A message id's handler runs to success or final failure once while
//     its record is kept (the engine's retention, engine.WithRetention): a
//     redelivery, or a resend after JetStream's duplicate window, is
//     acknowledged without running it, even on another worker or process
//     that shares the store. (In
//     two-phase mode, a run that died or outlasted its lease runs again:
//     see package consumer.)
//   - With consumer.WithAtomic on store/postgres, the handler's writes
//     commit with the message's record, or not at all: each message has
//     exactly one effect, whatever dies when.
//   - A message without an id, or whose id was first used with another body,
//     never runs: it is terminated (Term), after the dead-letter hook.
//   - A message that failed for good is recorded and acknowledged; every
//     delivery of it goes to the WithDeadLetter hook, so that the dead letter
//     is sent at least once.
//   - New refuses a consumer that does not acknowledge explicitly, one
//     whose messages may be redelivered after their record expires (for
//     up to the stream's max age, and up to max deliver times the longest
//     wait between two deliveries; without either, for ever), unless core has consumer.WithHorizonWarning, and one that scopes
//     Nats-Msg-Id by tenant, unless WithMessageIDsUniqueAcrossTenants.
//   - The hooks of core's engine (engine.WithHooks) run once per delivery,
//     before Handle acknowledges it: one execution per message id, then a
//     replay per redelivery or resend.
//
// # Caveats
//
//   - Without consumer.WithAtomic, a consumer that dies after the handler's
//     effects and before the record leaves the id in progress until its
//     lease ends; the redelivery then runs the handler again.
//   - Every negative acknowledgement counts as a delivery. With a max
//     deliver, the last delivery of a message that keeps failing goes to the
//     dead-letter hook and is acknowledged (JetStream would drop it); a
//     redelivery that finds its message in progress elsewhere is delayed
//     until that run's lease ends, so as to spend few deliveries. A handler
//     that runs longer than the ack wait should call msg.InProgress, or the
//     message is redelivered meanwhile.
//   - The last delivery of a message in progress elsewhere waits in Handle
//     for that run to end, holding its worker (at most the run's lease, and
//     at most consumer.WithHandlerTimeout), and takes the message over if
//     the run released it: a run that fails for now after JetStream's last
//     delivery cannot have it redelivered (see package consumer).
//   - Handle acknowledges with Ack, which JetStream does not confirm: a lost
//     acknowledgement means a redelivery after the ack wait, dropped as a
//     duplicate.
package idemnats
