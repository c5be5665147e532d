// Package idemkafka processes the records of a Kafka consumer group at most
// once per message id, with github.com/twmb/franz-go's kgo client: a thin
// adapter of the broker-neutral consumer package, which decides, and of the
// idemkey store under it, which remembers.
//
// The key is a message id that the producer sets, the same on every
// resend: by default the record's message-id header (MessageID;
// CloudEventsID for a CloudEvent's ce_id; WithMessageID for another, a
// function of the record, such as one that reads its key), scoped by the
// consumer's name and, with WithMessageTenant, by the tenant. Kafka drops
// no record for its id (an idempotent producer's sequence numbers only stop
// one producer session's retries), so every resend reaches the consumer,
// and idemkey drops it. A record already processed is committed without
// running the handler; a handler's final error is recorded, dead-lettered
// and committed; a transient one releases the id, and the record is
// processed again in place, after consumer.WithBackoff's delay, up to
// WithMaxAttempts times (five by default), the last of which dead-letters
// it rather than retry: Kafka cannot redeliver one record, and a partition
// must move on. A record refused (no id, a reused id, a tenant function's
// error, sent longer ago than the retention) is dead-lettered and committed
// without running.
//
// # Offsets
//
// Kafka's commit is a partition's offset: every record before it is done
// with. So the client must commit only what it is told (kgo.DisableAutoCommit),
// and Settle commits a record's offset only once its outcome is durable:
// recorded as processed or failed, or dead-lettered. A record whose context
// ended while it waited for a retry is not settled: Settle sets its
// partition back to it (cl.SetOffsets), the records after it in the poll
// are skipped (ErrRewound), and no offset past it is committed; the next
// poll brings them again.
//
// A rebalance is held while a poll's records are processed
// (kgo.BlockRebalanceOnPoll; the loop calls cl.AllowRebalance once they are
// settled), so that no partition is revoked from under records in hand: its
// new owner starts at the offset committed after them. A member that holds
// a poll for longer than the group's rebalance timeout is removed from the
// group; its commits are then refused by the group's coordinator (a commit
// from an earlier generation), so a revoked partition's records in flight
// are never acknowledged by the member that lost them: the new owner
// processes them again, and drops as duplicates those that were recorded.
// Keep a poll's work (WithHandlerTimeout times the batch, and a retry's
// backoff) well within the rebalance timeout (kgo.RebalanceTimeout, a minute
// by default).
//
// New refuses a client with autocommit on, without kgo.BlockRebalanceOnPoll,
// without a group, or consuming topics by regular expression (New reads each
// topic's retention).
//
// # Example
//
//	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention))
//	if err != nil { ... }
//	core, err := consumer.New(eng, "billing", consumer.WithSystem("kafka"), consumer.WithAtomic())
//	if err != nil { ... }
//	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:9092"),
//		kgo.ConsumerGroup("billing"), kgo.ConsumeTopics("orders"),
//		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())
//	if err != nil { ... }
//	defer cl.CloseAllowingRebalance() // a poll holds rebalances, and so Close
//	c, err := idemkafka.New(ctx, core, cl, func(ctx context.Context, r *kgo.Record) error {
//		return bill(ctx, r.Value) // writes through postgres.TxFromContext(ctx)
//	}, idemkafka.WithDeadLetterTopic("orders-dlq"))
//	if err != nil { ... } // a *consumer.HorizonError, say
//	for {
//		rs, err := c.NextBatch(ctx, 32, 5*time.Millisecond)
//		if err != nil {
//			break // ctx done, or the client closed
//		}
//		c.HandleBatch(ctx, rs) // or c.Handle(ctx, r) for each
//		cl.AllowRebalance()
//	}
//
// # Batches
//
// HandleBatch deduplicates a poll's records together (in atomic mode one
// round trip and one transaction: consumer.Consumer.ProcessBatch) and
// commits their offsets in one commit; the records that fail for now are
// retried together, and their partitions committed up to them only once
// they are settled.
//
// # Dead letters
//
// WithDeadLetterTopic writes a record that failed for good, was refused or
// ran out of attempts to a topic, with its key, value and headers, and the
// headers idemkey-error (why, in idemkey's words or the handler's gRPC
// code, never the handler's own words, which may quote the record),
// idemkey-topic, idemkey-partition and idemkey-offset, before its offset is
// committed.
// WithDeadLetter is a hook of one's own; New refuses neither unless the
// core discards dead letters (consumer.WithDiscardDeadLetters). A dead
// letter that fails to be written leaves the record uncommitted: it is
// processed again, never skipped in silence, and written at least once.
//
// # Retention and the redelivery horizon
//
// New reads each topic's retention.ms, segment.ms and cleanup.policy and
// refuses (a *consumer.HorizonError) when records of message ids would
// expire while Kafka keeps a record a group may read again
// (docs/consumers.md); consumer.WithHorizonWarning logs it instead.
//
// # What it was tested against
//
// On franz-go's kfake, an in-process Kafka of one broker without
// replication, or on a cluster named by IDEMKEY_TEST_KAFKA:
// docs/consumers.md says what that leaves untested (acknowledged writes
// lost to an unclean leader election: produce dead letters with acks=all).
//
// # Caveats
//
//   - Without consumer.WithAtomic, a consumer that dies after the handler's
//     effects and before the record leaves the id in progress until its
//     lease ends; the record's next delivery then runs the handler again.
//   - A record in progress elsewhere (a duplicate on another partition, or
//     a record of a member that died, in two-phase mode) is processed again
//     after that run's lease, holding the poll; its last attempt waits for
//     the run to end (see package consumer).
//   - A record that fails for now holds its partition while it retries.
package idemkafka
