// Package outbox carries a handler's messages from its transaction to a
// broker: a message is written in the same PostgreSQL transaction as the
// handler's writes (and, in atomic mode, the key's record), so that it
// exists if and only if they commit, and a Relay sends it once they have.
// Each message's id derives from the call's idempotency key and its place
// in the call, so a re-run of the handler makes the same ids and the outbox
// keeps the first copy; the relay sends the id as the broker's duplicate id,
// and idemkey's consumers downstream drop a resend. One key, one effect
// downstream.
//
//	ob, err := outbox.New(st) // st: a *postgres.Store, on schema 004
//
//	func (s *server) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
//		tx, _ := postgres.TxFromContext(ctx) // atomic mode's; a two-phase handler's own: postgres.ContextWithTx
//		// ... INSERT the charge through tx ...
//		err := s.outbox.Publish(ctx, outbox.Message{Destination: "payments.charge.created", Payload: body})
//		...
//	}
//
//	pub, err := idemnats.NewPublisher(js) // or idemamqp's, idemkafka's
//	relay, err := ob.Relay(pub)
//	go relay.Run(ctx) // or the command: idemkey relay
//
// # Guarantees
//
//   - A message is never lost: the relay marks it sent only after the broker
//     confirmed it, and a relay that dies leaves its claim to end (WithLease)
//     for another to take.
//   - A message is sent more than once only when a relay died, took longer
//     than its lease, or lost the broker's or the store's answer; the resend
//     has the same id, which JetStream's duplicate window and idemkey's
//     consumers (on every broker) drop.
//   - A partition's messages (PartitionKey, by default one per call's key)
//     are sent in the order they were written, each once the one before it
//     is confirmed, for transactions that commit one after another. Several
//     relays may run at once.
//   - Messages are sealed in the table when the Outbox has a sealer
//     (WithSealer): give it the engine's.
//
// # Caveats
//
//   - Ids are numbered in the order a run publishes: a handler that
//     publishes different messages, or in another order, on a re-run makes
//     other ids, and one that retries its own transaction inside a call
//     numbers on. The first message of an id wins, across the whole table.
//   - A partition of your own (a customer id) is sent in the order written,
//     which is the commit order only for transactions that commit one after
//     another; and many messages in few partitions make each claim read
//     further into a large backlog.
//   - In two-phase mode a re-run after the handler's own commit (a crash
//     before the record) writes again whatever is not idempotent by itself;
//     its messages, of the same ids, are dropped. Derive the handler's ids
//     from the key too (idemkey.DerivedKey), or use atomic mode.
//   - Keep sent messages (WithRetention) as long as the operations' records:
//     a re-run after the sweep would write its copy again.
//   - A message that a broker refuses for good (no such queue) is tried
//     again with a backoff until it is sent or an operator deletes it; it
//     holds back the rest of its partition, and the failures are in the
//     relay's log and idemkey.outbox.failed.
//
// docs/outbox.md in the repository has the path from a key to a receipt.
package outbox
