package idemkafka

import (
	"context"
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/store"
)

// NextBatch polls the client for the next batch of at most n records
// (cl.PollRecords): it waits for the first until ctx is done, then takes the
// records the client holds, and those that arrive within maxWait of the
// first, up to n. It never waits longer for a full batch: a batch is what
// is there. Its error is kgo.ErrClientClosed once the client is closed, or
// ctx's; a fetch's other errors (which kgo retries) are logged.
//
// A poll holds the group's rebalances (kgo.BlockRebalanceOnPoll) until
// cl.AllowRebalance: call it after the batch is settled, and close the
// client with cl.CloseAllowingRebalance.
//
//	for {
//		rs, err := c.NextBatch(ctx, 32, 5*time.Millisecond)
//		if err != nil {
//			break
//		}
//		c.HandleBatch(ctx, rs)
//		cl.AllowRebalance()
//	}
func (c *Consumer) NextBatch(ctx context.Context, n int, maxWait time.Duration) ([]*kgo.Record, error) {
	n = max(n, 1)
	var rs []*kgo.Record
	for len(rs) == 0 {
		more, err := c.poll(ctx, n)
		if err != nil {
			return nil, err
		}
		rs = more
		if len(rs) == 0 {
			c.cl.AllowRebalance() // nothing was polled that a rebalance could take
		}
	}
	if len(rs) >= n || maxWait <= 0 {
		return rs, nil
	}
	wait, cancel := context.WithTimeout(ctx, maxWait)
	defer cancel()
	for len(rs) < n && wait.Err() == nil {
		more, err := c.poll(wait, n-len(rs))
		if err != nil {
			break // the wait ended, or the client closed: the next call says so
		}
		rs = append(rs, more...)
	}
	return rs, nil
}

// poll polls up to n records; its error is ctx's, or kgo.ErrClientClosed.
func (c *Consumer) poll(ctx context.Context, n int) ([]*kgo.Record, error) {
	fetches := c.cl.PollRecords(ctx, n)
	if fetches.IsClientClosed() {
		return nil, kgo.ErrClientClosed
	}
	rs := fetches.Records()
	if err := ctx.Err(); err != nil && len(rs) == 0 {
		return nil, err
	}
	fetches.EachError(func(_ string, _ int32, err error) {
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			c.core.Warn(ctx, "fetching records failed; the client fetches them again", err)
		}
	})
	return rs, nil
}

// HandleBatch processes rs together and commits their offsets in one
// commit: ProcessBatch, then SettleBatch. rs are records of one poll, in
// the order it returned them. It returns the outcomes, in the order of rs.
func (c *Consumer) HandleBatch(ctx context.Context, rs []*kgo.Record) []consumer.Result {
	results := c.ProcessBatch(ctx, rs)
	c.SettleBatch(ctx, rs, results)
	return results
}

// ProcessBatch decides what becomes of each of rs, as Process decides one,
// and returns the outcomes in the order of rs, without committing them:
// SettleBatch does. In atomic mode on store/postgres, the batch is
// deduplicated in one round trip and its handlers run in one transaction
// that commits once, each record's writes apart from the others'
// (consumer.Consumer.ProcessBatch); in two-phase mode one statement
// reserves the batch's ids, and each record is then processed as Process
// does; on another store its records are processed one at a time. The
// records that failed for now are processed again together, after the
// longest of their delays, up to WithMaxAttempts times, as Process does.
func (c *Consumer) ProcessBatch(ctx context.Context, rs []*kgo.Record) []consumer.Result {
	results := make([]consumer.Result, len(rs))
	pending := make([]int, 0, len(rs)) // the records to process at this attempt
	for i, r := range rs {
		if c.skipped(r) {
			results[i] = consumer.Result{Outcome: consumer.Retry, Action: consumer.Nak, Err: ErrRewound}
			continue
		}
		pending = append(pending, i)
	}
	for attempt := 1; len(pending) > 0; attempt++ {
		if attempt > 1 && !c.waitRetry(ctx, results, pending) {
			break
		}
		c.attempt(ctx, rs, results, pending, attempt)
		again := pending[:0]
		for _, i := range pending {
			if results[i].Action == consumer.Nak && attempt < c.opts.maxAttempts {
				again = append(again, i)
			}
		}
		pending = again
	}
	return results
}

// waitRetry waits out the longest delay of the pending results, and says
// whether ctx is still live, and will be after it (store.Pause).
func (c *Consumer) waitRetry(ctx context.Context, results []consumer.Result, pending []int) bool {
	var d time.Duration
	for _, i := range pending {
		d = max(d, results[i].Delay)
	}
	return store.Pause(ctx, d)
}

// attempt sets results[i], for each i of pending, to the outcome of the
// attempt-th processing of rs[i], dead letter included.
func (c *Consumer) attempt(ctx context.Context, rs []*kgo.Record, results []consumer.Result, pending []int, attempt int) {
	ds := make([]consumer.Delivery, 0, len(pending))
	at := make([]int, 0, len(pending)) // the record of each delivery
	for _, i := range pending {
		d, err := c.delivery(rs[i], attempt)
		if err != nil {
			results[i] = c.core.Refuse(ctx, err)
			continue
		}
		ds = append(ds, d)
		at = append(at, i)
	}
	switch len(ds) {
	case 0:
	case 1:
		r := rs[at[0]]
		results[at[0]] = c.core.Process(ctx, ds[0], func(ctx context.Context) error { return c.h(ctx, r) })
	default:
		out := c.core.ProcessBatch(ctx, ds, func(ctx context.Context, j int) error { return c.h(ctx, rs[at[j]]) })
		for j, i := range at {
			results[i] = out[j]
		}
	}
	for _, i := range pending {
		results[i] = c.core.DeadLetter(ctx, results[i], c.deadLetter(rs[i]))
	}
}

// SettleBatch commits, in one commit, the offset of each partition of rs
// past its records that results settle, as Settle does for one: in each
// partition, up to the first record whose Action is Nak, to which
// SettleBatch sets the partition back. rs are records of one poll, in the
// order it returned them, and results their outcomes.
func (c *Consumer) SettleBatch(ctx context.Context, rs []*kgo.Record, results []consumer.Result) {
	var commit []*kgo.Record
	stopped := map[topicPartition]bool{}
	rewind := map[string]map[int32]kgo.EpochOffset{}
	for i, r := range rs {
		tp := topicPartition{r.Topic, r.Partition}
		switch {
		case stopped[tp]:
		case errors.Is(results[i].Err, ErrRewound): // set back already
			stopped[tp] = true
		case results[i].Action == consumer.Nak:
			stopped[tp] = true
			if rewind[r.Topic] == nil {
				rewind[r.Topic] = map[int32]kgo.EpochOffset{}
			}
			rewind[r.Topic][r.Partition] = kgo.EpochOffset{Epoch: r.LeaderEpoch, Offset: r.Offset}
		default:
			commit = append(commit, r)
		}
	}
	if len(rewind) > 0 {
		c.mu.Lock()
		for topic, ps := range rewind {
			for p, at := range ps {
				c.setBack(topicPartition{topic, p}, at.Offset)
			}
		}
		c.mu.Unlock()
		c.cl.SetOffsets(rewind)
	}
	if len(commit) == 0 {
		return
	}
	err := c.cl.CommitRecords(ctx, commit...)
	if err == nil {
		return
	}
	c.core.Warn(ctx, "committing offsets failed; the records are delivered again and dropped as duplicates", err)
	if !lostMembership(err) {
		return
	}
	// The group moved on without this member: its partitions are another's,
	// and the records after these are skipped, until a later assignment
	// fetches them again, from the offsets committed.
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range commit {
		c.setBack(topicPartition{r.Topic, r.Partition}, r.Offset)
	}
}

// lostMembership says whether err, a commit's, is the group coordinator's
// refusal of a member that is no longer in the group's generation.
func lostMembership(err error) bool {
	return errors.Is(err, kerr.UnknownMemberID) || errors.Is(err, kerr.IllegalGeneration) ||
		errors.Is(err, kerr.FencedInstanceID) || errors.Is(err, kerr.RebalanceInProgress)
}
