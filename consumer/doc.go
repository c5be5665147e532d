// Package consumer drops the duplicates of at-least-once delivery: it runs a
// message consumer's handler once per message id, on idemkey's engine and
// stores, and owns each delivery's life: read, run, dead-letter, settle. It
// knows no broker: idemnats (NATS JetStream), idemamqp (RabbitMQ) and
// idemkafka (Kafka) each give it a Broker, the seam a new broker implements.
//
//	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention))
//	b, err := idemnats.New(ctx, stream, cons)
//	c, err := consumer.New(eng, "billing", b, bill, consumer.WithAtomic(),
//		consumer.WithDeadLetter(func(ctx context.Context, msg jetstream.Msg, err error) error {
//			return keep(ctx, msg.Data(), consumer.Cause(err))
//		}))
//	cc, err := cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
//
// The key is the producer's message id (the Broker's ID, or WithMessageID),
// scoped by the consumer's name and, with WithMessageTenant, by the tenant.
// The engine holds what every entry point shares: the store, the retention,
// leases, sealing, logging, hooks and metrics. Give it a retention of days
// (RecommendedRetention): New refuses one that the broker's redelivery
// horizon outlasts.
//
// # What becomes of a delivery
//
//	Outcome      Action                       when
//	Processed    ack                          the handler succeeded; recorded
//	Duplicate    ack, without running         recorded before
//	Busy         nak, until the other run's lease ends (the last delivery waits)
//	Retry        nak, after a backoff         a transient error: the id is released
//	Failed       ack, and the dead letter     a final error: recorded, atomic writes undone
//	Rejected     reject, and the dead letter  no id, a reused id, a refused tenant, sent before the retention
//	StoreFailed  nak, after a backoff         the store failed; the last delivery is held until it answers
//
// A handler's error is final if it is marked with Final or is a gRPC status
// the gRPC interceptor records (IsFinal; WithClassifier changes it); any
// other error, and a panic (ErrPanicked), is transient. On a message's last
// delivery a message that would be delivered again is dead-lettered instead;
// a failing store never spends a last delivery. New refuses a consumer with
// no dead-letter hook unless WithDiscardDeadLetters. With WithAtomic on
// store/postgres the handler's writes commit with the message's record, so
// each message takes effect exactly once.
//
// docs/consumers.md has the rest: batches (HandleBatch: one round trip and
// one commit in atomic mode), the last delivery of a message in progress
// elsewhere, horizons, hooks and sealing. docs/answers.md is the one table
// of what every situation answers on every entry point.
package consumer
