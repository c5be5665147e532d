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
// In atomic mode, HandleBatch saves most of what idemkey costs a record: it
// deduplicates a poll's records in one round trip, runs their handlers in
// one transaction, each record's writes apart, and commits their offsets in
// one commit after that transaction's one commit
// (consumer.Consumer.ProcessBatch). In two-phase mode a batch saves one
// round trip per record. The records of a batch that fail for now are
// processed again together, after the longest of their delays; the
// offsets of their partitions are committed up to them only once they are
// settled.
//
// # Dead letters
//
// WithDeadLetterTopic writes a record that failed for good, was refused or
// ran out of attempts to a topic, with its key, value and headers, and the
// headers idemkey-error (why, in idemkey's words or the handler's gRPC
// code, never the handler's own words, which may quote the record),
// idemkey-topic, idemkey-partition and idemkey-offset, before its offset is
// committed.
// WithDeadLetter is a hook of one's own. Either way, a dead letter that
// fails to be written leaves the record uncommitted: it is processed again,
// never skipped in silence. A dead letter is written at least once.
//
// # Retention and the redelivery horizon
//
// A record may be read again while Kafka keeps it: a group whose offsets
// are reset or expired, or a partition whose new owner starts at an older
// commit. Kafka deletes a record with its segment, once the segment's newest
// record is older than retention.ms, and a segment takes records for up
// to segment.ms. New reads both, and cleanup.policy, for each topic (with
// kadm) and refuses (a *consumer.HorizonError) when records of message ids
// would expire first: when retention.ms plus segment.ms exceeds the
// engine's retention, or the topic keeps records for ever (retention.ms -1,
// or cleanup.policy compact without delete); with
// consumer.WithHorizonWarning it logs that at Error level instead. Kafka's
// defaults (seven days each, fourteen in all) outlast the seven days of
// consumer.RecommendedRetention: give the topic, say, a retention.ms of
// three days and a segment.ms of one.
// Kafka's deletion also waits for its retention check
// (log.retention.check.interval.ms, five minutes by default), which the
// horizon leaves to the margin of days.
//
// # What it was tested against
//
// The tests (tests/idemkafka, and the example consumer's kill-and-restart
// soak) run against franz-go's kfake, an in-process Kafka of one broker,
// with kgo's default, the classic consumer group protocol (not KIP-848's),
// or against a real cluster named by IDEMKEY_TEST_KAFKA: tests/idemkafka
// with kgo's default balancer (cooperative-sticky) and, for a member
// removed mid-poll, the eager range balancer; the soak with range. On
// kfake, a soak in two-phase mode with batches, in which a member's commit
// was refused (ILLEGAL_GENERATION) while its poll held a record busy
// elsewhere, once left two partitions unassigned for minutes with
// cooperative-sticky; not diagnosed, and not seen with range. kfake models
// groups, generations, rebalance timeouts, committed offsets and topic
// configurations; it does not model replication: a real cluster adds
// acknowledged writes lost to an unclean leader election
// (unclean.leader.election.enable), or to a leader's failure before
// followers copied them with acks below all or min.insync.replicas of one:
// an offset committed past a record that is then lost is harmless, but a
// dead letter written with too weak an acknowledgement may be lost. Produce
// dead letters with the default, acks=all, on a topic with
// min.insync.replicas of at least two.
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
//   - A record that fails for now holds its partition, and the poll, while
//     it waits for its retries.
package idemkafka
