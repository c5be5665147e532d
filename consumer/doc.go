// Package consumer drops the duplicates of at-least-once delivery: it runs a
// message consumer's handler once per message id, on idemkey's
// engine and stores, and tells the broker adapter what to do with each
// delivery. It knows no broker: idemnats (NATS JetStream) and idemamqp
// (RabbitMQ) read a message's id, tenant and delivery count into a Delivery,
// call Process, and act on its Result.
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
//	// then idemnats.New(ctx, core, ...) or idemamqp.New(core, ...)
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
//	                                                  the last delivery: waited for, below)
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
// # The last delivery of a message in progress elsewhere
//
// Every message ends processed, recorded as failed, or dead-lettered, even
// when its last delivery finds another run holding its id (a run of an
// earlier delivery that outlasted the ack wait, or whose channel closed).
// That delivery cannot be left to the other run, as an earlier one is: the
// run may yet fail for now, release the id and negative-acknowledge a
// message that the broker no longer delivers. So Process waits for the
// other run to end, polling the store (the engine's wait for a key in
// progress: from 25ms, doubling to half a second, each poll a reservation,
// which takes the id over once the other run's lease has ended), and holds
// its worker meanwhile:
//
//   - the other run recorded the message: a Duplicate, acknowledged (and
//     dead-lettered again if it failed for good);
//   - it released the id (a transient failure), or its lease ended (it
//     died): the last delivery runs the handler itself, and dead-letters a
//     transient failure;
//   - ctx is done first, or other runs hold the id for longer than the
//     longest lease (engine.WithMaxLease, ten minutes by default): the
//     message is dead-lettered, still Busy, with ErrLastDelivery, and
//     acknowledged. The other run may still succeed: a dead letter is sent
//     at least once.
//
// WithHandlerTimeout bounds each run of the handler, not this wait: with it,
// the other run's lease is the timeout plus a few seconds, after which the
// last delivery takes the message over, and its handler has the whole
// timeout.
//
// The broker's ack wait may pass meanwhile: neither broker delivers the
// message again, and the outcome stands. Two simpler designs hold no worker
// but are not as sound. Dead-lettering at once sends a dead letter for a
// message that the other run, as it usually does, then processes. And the
// other run, failing for now, cannot tell that its message will not be
// redelivered: a broker counts deliveries on the newest one only
// (JetStream's NumDelivered, a quorum queue's x-delivery-count), and its
// own delivery's count is older.
//
// # Batches
//
// ProcessBatch decides a batch of deliveries at once (idemnats and idemamqp:
// NextBatch takes one from JetStream or a RabbitMQ prefetch, HandleBatch
// processes and acknowledges it). In atomic mode on store/postgres, one
// round trip reads the record of every id of the batch and takes the free
// ones; the handlers run one after another in one transaction, each
// message's writes apart from the others' (a savepoint each), so that a
// message that fails, for good or for now, has its own writes undone and
// the others' commit; and the records commit with the writes in one commit.
// Every message is acknowledged after that commit. One at a time, a
// consumer pays two round trips and a commit per message besides its
// handler's statements; a batch of n pays two round trips and one commit
// in all (BENCHMARKS.md has the measured rates). Each message answers as it
// would one at a time, with these differences:
//
//   - an id that an earlier message of the batch has is decided after the
//     batch's commit, on its own: a duplicate of the earlier message, if
//     that was recorded;
//   - every id the batch acquired stays held until the batch commits, so a
//     redelivery of one of them meanwhile is Busy for longer;
//   - a rare race (another consumer recorded an id of the batch between
//     the batch's read and its commit), or a transaction that fails before
//     its commit (its connection lost, a handler that ended it), commits
//     nothing of the batch; its messages are then processed one at a time,
//     and the handlers that ran in the batch run again, their first run
//     undone.
//
// In two-phase mode on store/postgres, one statement reserves every free id
// of the batch and reads the record of every other; each message's handler
// then runs, and its record is written (or its id released), as one at a
// time, so a batch of n pays n+1 round trips of the store's besides its
// handlers' statements instead of 2n. Each id is reserved with one
// message's lease: a message whose lease the handlers before it have
// mostly used up is released and processed on its own after the others.
// On another store, ProcessBatch processes the messages one at a time, as
// Process does.
//
// # Retention and the redelivery horizon
//
// A record must outlive every redelivery of its message: a redelivery after
// the record expired runs again. So records are kept for days
// (RecommendedRetention, seven, given to engine.WithRetention), not the
// hours of an API's key (engine.DefaultRetention), and the
// adapters read the broker's own bounds into a Horizon (JetStream: the
// stream's max age, the consumer's ack wait times max deliver; RabbitMQ: the
// queue's x-message-ttl) and refuse to start when records would expire first,
// or, with WithHorizonWarning, log it at Error level.
//
// # Modes
//
// Two-phase (the default, any handler, any store): the id is reserved, the
// handler runs, its outcome is recorded, then the message is acknowledged. A
// consumer that dies after the handler's effects and before the record
// leaves the id in progress until its lease ends (engine.WithLease, or
// WithHandlerTimeout plus a few seconds); the redelivery after that runs the
// handler again. One that dies after the record is dropped as a duplicate.
// The lease is also how long a handler may run before a redelivery presumes
// it dead: without WithHandlerTimeout, a handler that outlasts its lease
// (a minute by default) may run a second time while the first still runs.
//
// Atomic (WithAtomic, on store/postgres): the handler writes through the
// transaction in its context (postgres.TxFromContext), which commits with
// the message's record. Each message takes effect exactly once, whatever
// dies when: before the commit everything rolls back and the redelivery
// runs again; after it, the redelivery is a duplicate.
//
// # Sealing
//
// A consumer records only whether a message was processed or failed, never
// what the handler did, so there is nothing to redact. engine.WithSealer seals that
// record too (package seal), so that someone who can write the store cannot
// turn a failed message into a processed one; a record the key ring cannot
// open is answered StoreFailed (negative-acknowledged, its last delivery
// held as in any outage) and never processed again.
package consumer
