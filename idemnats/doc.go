// Package idemnats is the NATS JetStream Broker of package consumer, for
// github.com/nats-io/nats.go's jetstream package: New reads a JetStream
// consumer and its stream, and consumer.New, on that Broker, runs a handler
// once per message id and settles each message as its consumer.Result says
// (Ack, Term, or NakWithDelay after the Result's Delay).
//
// The key is the message's Nats-Msg-Id header (MessageID), scoped by the
// consumer's name. JetStream drops a producer's resends of it within the
// stream's duplicate window; idemkey covers the rest: a resend after the
// window, and every redelivery. A CloudEvent's id is its ce-id header:
// consumer.WithMessageID(idemnats.CloudEventsID). With tenants
// (consumer.WithMessageTenant) idemkey scopes an id by the tenant, but
// JetStream does not: it drops a Nats-Msg-Id it stored within the window,
// whichever the tenant, and one tenant's message is lost when another's has
// its id. So consumer.New refuses a tenant function with the default
// MessageID (a *DuplicateWindowError): publish every Nats-Msg-Id unique
// across tenants ("acme/order-1001") and read it with
// consumer.WithMessageID(idemnats.UniqueMessageID), or read the tenant's own
// id from another header.
//
//	b, err := idemnats.New(ctx, stream, cons) // cons: AckExplicitPolicy
//	if err != nil { ... }
//	c, err := consumer.New(eng, "billing", b, func(ctx context.Context, msg jetstream.Msg) error {
//		return bill(ctx, msg.Data())
//	}, consumer.WithDeadLetter(keep))
//	if err != nil { ... } // a *consumer.HorizonError: the stream's max age outlives eng's retention, say
//	cc, err := cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
//
// For batches, NextBatch takes them from a cons.Messages iterator, and
// c.HandleBatch processes and settles each (in atomic mode on
// store/postgres, in one round trip and one commit).
//
// NewPublisher is the other side, for package outbox's Relay: it publishes
// each message to its Destination subject with its ID as the Nats-Msg-Id,
// which the stream's duplicate window drops a resend of and New's
// consumers read as the key, so that an outbox message is one key here.
//
// Caveats of JetStream's:
//   - Every negative acknowledgement (NakWithDelay: a failure for now, or a
//     message in progress elsewhere) counts as a delivery against the
//     consumer's max deliver.
//   - With a max deliver, the last delivery of a message that fails for now,
//     or is still in progress elsewhere once it stopped waiting for that
//     run, is dead-lettered (consumer.WithDeadLetter) and acknowledged:
//     JetStream would drop it. The redelivery horizon that consumer.New
//     checks is the stream's max age, and max deliver times the longest wait
//     between two deliveries; without either, for ever.
//   - A handler that runs longer than the ack wait should call
//     msg.InProgress, or JetStream delivers the message again meanwhile.
//   - Ack is not confirmed: a lost acknowledgement means a redelivery after
//     the ack wait, dropped as a duplicate.
//
// docs/consumers.md has the rest: modes, guarantees, batches, the last
// delivery of a message in progress elsewhere, and the redelivery horizon.
package idemnats
