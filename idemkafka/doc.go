// Package idemkafka is the Kafka Broker of package consumer: the records
// that a consumer group polls with github.com/twmb/franz-go's kgo client,
// run by a consumer.Consumer at most once per message id, their offsets
// committed by the Broker.
//
// The key is a message id that the producer sets, the same on every
// resend: the record's message-id header by default (MessageID),
// CloudEventsID for a CloudEvent's ce_id, or consumer.WithMessageID for
// another, such as one that reads the record's key. Kafka drops no resend;
// idemkey does.
//
//	b, err := idemkafka.New(ctx, cl) // checks cl's options and reads its topics' retention
//	if err != nil { ... }
//	c, err := consumer.New(eng, "billing", b, bill,
//		consumer.WithDeadLetter(idemkafka.DeadLetterTopic(cl, "billing.dead")))
//	if err != nil { ... } // a *consumer.HorizonError, say
//	for {
//		rs, err := idemkafka.NextBatch(ctx, cl, 32, 5*time.Millisecond)
//		if err != nil {
//			break // ctx done, or the client closed
//		}
//		c.HandleBatch(ctx, rs) // runs, dead-letters and commits
//		cl.AllowRebalance()
//	}
//
// NewPublisher is the other side, for package outbox's Relay: it produces
// each message to its Destination topic, keyed by its PartitionKey, with
// its ID in the message-id header that New's consumers read as the key.
// Kafka drops no resend: a message the Relay sends twice is two records,
// and the consumer drops the second.
//
// # Offsets
//
// A commit is a partition's offset: every record before it is done with.
// The Broker commits a poll's offsets in one commit, only past records whose
// outcome is durable: processed, recorded as failed, or dead-lettered. A
// record left to be delivered again (Nak: its context ended before its next
// attempt, or its dead letter was not written) sets its partition back to
// it; the partition's later records in hand are skipped unrun (Retry, Nak,
// ErrRewound), and the next poll brings them all again.
//
// # Rebalances
//
// The client holds rebalances while a poll's records are handled
// (kgo.BlockRebalanceOnPoll; then cl.AllowRebalance; close with
// cl.CloseAllowingRebalance): no partition is revoked from under them. A
// member that holds a poll past the group's rebalance timeout is removed
// from the group, and the coordinator refuses its commits (logged by the
// consumer): the partition's new owner gets the records again and drops
// those recorded as duplicates, and the member skips the partition's
// records still in hand (ErrRewound). Keep a poll's work well within
// kgo.RebalanceTimeout.
//
// # Attempts
//
// Kafka cannot deliver one record again, so the consumer tries a record
// that fails for now again in process, after each backoff
// (consumer.WithBackoff), up to WithMaxAttempts times (5 by default), the
// last of which dead-letters it (consumer.ErrLastDelivery) rather than
// hold its partition. Write dead letters with kgo's default acks=all, to a
// topic with min.insync.replicas of two or more: one lost is lost for good.
//
// # What New refuses
//
// New refuses a client without a group (kgo.ConsumerGroup), with
// autocommit (kgo.DisableAutoCommit), without kgo.BlockRebalanceOnPoll, or
// with topics by regular expression (kgo.ConsumeRegex), and topics whose
// configuration it cannot read; consumer.New then refuses topics that keep
// records longer than the engine's retention. docs/consumers.md ("Kafka")
// has the horizon, and what the tests on kfake leave untested.
package idemkafka
