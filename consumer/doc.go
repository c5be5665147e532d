// Package consumer drops the duplicates of at-least-once delivery: it runs a
// message consumer's handler once per message id, on idemkey's
// engine and stores, and tells the broker adapter what to do with each
// delivery. It knows no broker: idemnats (NATS JetStream), idemamqp
// (RabbitMQ) and idemkafka (Kafka) read a message's id, tenant and delivery
// count into a Delivery, call Process, and act on its Result.
//
// Every broker redelivers: after a consumer crashed before its
// acknowledgement, after an ack timeout, after a broker restart, when a
// producer publishes again. The key is the producer-assigned message id,
// scoped by the consumer's name (two consumers of one stream each process
// every message once) and by the tenant, if the adapter reads one.
//
// A consumer runs on an engine (package engine), which holds the settings
// every entry point shares: the store, the retention, leases, sealing,
// logging, hooks and metrics. Give a consumer's engine a retention of days
// (RecommendedRetention; see below); it needs no tenant function, since the
// adapter reads each message's:
//
//	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention))
//	if err != nil { ... }
//	core, err := consumer.New(eng, "billing", consumer.WithSystem("nats"), consumer.WithAtomic())
//	if err != nil { ... }
//	// then idemnats.New(ctx, core, ...), idemamqp.New(core, ...) or idemkafka.New(ctx, core, ...)
//
// A broker may drop duplicates itself, before any consumer, and without a
// tenant: JetStream drops a message whose Nats-Msg-Id it stored within the
// stream's duplicate window, so a second tenant's message with a first one's
// id is lost. With a tenant, an id the broker reads must be unique across
// tenants (the tenant in the id: "acme/order-1001"), and idemnats.New refuses
// a tenant function with Nats-Msg-Id ids until the consumer says they are.
// Without a tenant, the broker's scope and idemkey's agree. RabbitMQ drops
// nothing.
//
// # What becomes of a delivery
//
//	outcome            broker action                  when
//	Processed          ack                            the handler succeeded; recorded
//	Duplicate          ack, without running           recorded before (counted: idemkey.calls, outcome "replayed")
//	Busy               nak, until the other run's lease ends
//	                                                  in progress on another worker (on
//	                                                  the last delivery: waited for)
//	Retry              nak, after a backoff           a transient error: the id is released
//	Failed             ack, and the dead-letter hook  a final error: recorded, undoing atomic writes
//	Rejected           reject (terminate), and the hook
//	                                                  no id, a reused id, a refused tenant, or
//	                                                  sent before the retention (ErrExpired)
//	StoreFailed        nak, after a backoff           the store failed, or had no room for a new
//	                                                  record (Err is store.ErrFull); a consumer
//	                                                  never runs unprotected; the last delivery
//	                                                  is held until the store answers
//
// A message the broker stamps (Delivery.Sent: JetStream's stored time, an
// AMQP timestamp) longer ago than the retention, less engine.WithClockSkew, whose
// id has no record, is Rejected with ErrExpired rather than processed: its
// record may have been there and expired, so running it could apply it
// twice (a message moved back by hand from a dead-letter queue days later).
// A record still there drops it as a Duplicate, as ever. The refusal is
// logged at Error level with ErrExpired, the message's age and the
// retention.
//
// The engine's hooks (engine.WithHooks) run one for each delivery, before
// Process returns and so before the adapter acknowledges: OnExecute for
// Processed, Failed and Retry (engine.Event.Recorded false for Retry),
// OnReplay for a Duplicate, OnRefuse for the others. Each is told the
// consumer's name, the tenant, the message id, the Action (Event.Code) and
// the record's size: a message redelivered n times after it was processed
// runs OnExecute once and OnReplay n times. A hook that panics is logged,
// and changes neither the Result nor the record.
//
// On a message's last delivery (JetStream's max deliver, a quorum queue's
// delivery limit), a message that would be redelivered after a failure of
// its handler is dead-lettered and acknowledged instead: the broker would
// give it up in silence. One in progress elsewhere is waited for (see
// below). A store that fails is no reason to spend a last delivery: Process
// holds it, trying again after each backoff until the store answers, so a
// message is never acknowledged unrun, nor dead-lettered for an outage (a
// consumer that stops meanwhile negative-acknowledges it, logged at Error
// level). An adapter hands dead letters to its hook (DeadLetter), and
// refuses to start without one unless the consumer is built with
// WithDiscardDeadLetters, which acknowledges such messages and logs each at
// Error level as discarded; only a message the hook took is logged as
// dead-lettered.
// A handler's error is final if it is marked with Final or is a gRPC status
// that the gRPC interceptor records; any other error, a plain one and
// InvalidArgument included (which the gRPC interceptor releases too), is
// transient (IsFinal; WithClassifier changes it), and so is a panic
// (ErrPanicked): the consumer recovers from it and goes on. The one table of
// every entry point's answers is docs/answers.md. The backoff doubles with
// each delivery the broker counts, from one second to a minute, less a random
// part of up to a quarter (WithBackoff).
//
// # More
//
// docs/consumers.md has the rest, whole: the last delivery of a message in
// progress elsewhere (it waits for the other run, at most its lease, and
// takes the message over if that run released it or died), batches
// (ProcessBatch: one round trip and one commit for a batch in atomic mode,
// n+1 round trips in two-phase mode), retention against the broker's
// redelivery horizon (CheckHorizon, RecommendedRetention), the two modes
// (two-phase, and atomic with WithAtomic on store/postgres, where each
// message takes effect exactly once), and sealing (engine.WithSealer seals a
// consumer's records too). docs/answers.md is the one table of what every
// situation answers on every entry point.
package consumer
