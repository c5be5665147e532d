package idemkafka

import (
	"context"
	"errors"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// NextBatch polls the client for the next batch of at most n records
// (cl.PollRecords): it waits for the first until ctx is done, then takes the
// records the client holds, and those that arrive within maxWait of the
// first, up to n. It never waits longer for a full batch: a batch is what
// is there. Its error is kgo.ErrClientClosed once the client is closed, or
// ctx's.
//
// A poll holds the group's rebalances (kgo.BlockRebalanceOnPoll) until
// cl.AllowRebalance: call it after the batch is handled (see New), and close
// the client with cl.CloseAllowingRebalance. The fetches' other errors,
// which kgo retries, are kgo's to log (kgo.WithLogger).
func NextBatch(ctx context.Context, cl *kgo.Client, n int, maxWait time.Duration) ([]*kgo.Record, error) {
	n = max(n, 1)
	var rs []*kgo.Record
	for len(rs) == 0 {
		more, err := poll(ctx, cl, n)
		if err != nil {
			return nil, err
		}
		rs = more
		if len(rs) == 0 {
			cl.AllowRebalance() // nothing was polled that a rebalance could take
		}
	}
	if len(rs) >= n || maxWait <= 0 {
		return rs, nil
	}
	wait, cancel := context.WithTimeout(ctx, maxWait)
	defer cancel()
	for len(rs) < n && wait.Err() == nil {
		more, err := poll(wait, cl, n-len(rs))
		if err != nil {
			break // the wait ended, or the client closed: the next call says so
		}
		rs = append(rs, more...)
	}
	return rs, nil
}

// poll polls up to n records; its error is ctx's, or kgo.ErrClientClosed.
func poll(ctx context.Context, cl *kgo.Client, n int) ([]*kgo.Record, error) {
	fetches := cl.PollRecords(ctx, n)
	if fetches.IsClientClosed() {
		return nil, kgo.ErrClientClosed
	}
	rs := fetches.Records()
	if err := ctx.Err(); err != nil && len(rs) == 0 {
		return nil, err
	}
	return rs, nil
}

// Settle commits, in one commit, the offset of each partition of rs past
// its records that results settle (Ack, or Reject: Kafka has nothing to
// reject, and the dead-letter hook has had the record): in each partition,
// up to the first record whose Action is Nak, to which Settle sets the
// partition back (cl.SetOffsets), so that it is fetched again and no
// offset past it is committed. rs are records of one poll, in its order.
//
// A commit the group refuses because this member left its generation (the
// partition was revoked meanwhile) is returned; the record is delivered
// again to whichever member has its partition and dropped as a duplicate,
// and the partition's later records in hand are skipped until this member
// is in a new generation.
func (b *broker) Settle(ctx context.Context, rs []*kgo.Record, results []consumer.Result) error {
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
		b.mu.Lock()
		for topic, ps := range rewind {
			for p, at := range ps {
				b.setBack(topicPartition{topic, p}, at.Offset)
			}
		}
		b.mu.Unlock()
		b.cl.SetOffsets(rewind)
	}
	if len(commit) == 0 {
		return nil
	}
	err := b.cl.CommitRecords(ctx, commit...)
	if err == nil || !lostMembership(err) {
		return err
	}
	// The group moved on without this member: its partitions are another's,
	// and the records after these are skipped, until a later assignment
	// fetches them again, from the offsets committed.
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range commit {
		b.setBack(topicPartition{r.Topic, r.Partition}, r.Offset)
	}
	return err
}

// lostMembership says whether err, a commit's, is the group coordinator's
// refusal of a member that is no longer in the group's generation.
func lostMembership(err error) bool {
	return errors.Is(err, kerr.UnknownMemberID) || errors.Is(err, kerr.IllegalGeneration) ||
		errors.Is(err, kerr.FencedInstanceID) || errors.Is(err, kerr.RebalanceInProgress)
}
