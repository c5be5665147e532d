package idemamqp

import (
	"cmp"
	"context"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
)

// NextBatch takes the next batch of at most n deliveries from deliveries
// (a Consume's, with autoAck false): it waits for the first, until ctx is
// done or deliveries is closed, then takes those ready, and those that
// arrive within maxWait of the first, up to n. It never waits longer for a
// full batch: a batch is what is there. It returns nil once ctx is done or
// deliveries is closed with nothing taken.
//
// RabbitMQ sends a channel at most its prefetch of unacknowledged
// deliveries (Channel.Qos): give it at least n for each worker that takes
// batches, or a batch can never be full.
//
//	ch.Qos(workers*32, 0, false)
//	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
//	...
//	for ds := idemamqp.NextBatch(ctx, deliveries, 32, 5*time.Millisecond); ds != nil; ds = idemamqp.NextBatch(ctx, deliveries, 32, 5*time.Millisecond) {
//		c.HandleBatch(ctx, ds)
//	}
func NextBatch(ctx context.Context, deliveries <-chan amqp.Delivery, n int, maxWait time.Duration) []amqp.Delivery {
	var first amqp.Delivery
	select {
	case d, ok := <-deliveries:
		if !ok {
			return nil
		}
		first = d
	case <-ctx.Done():
		return nil
	}
	ds := make([]amqp.Delivery, 1, max(n, 1))
	ds[0] = first
	// Those ready first, without a timer.
ready:
	for len(ds) < n {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return ds
			}
			ds = append(ds, d)
		default:
			break ready
		}
	}
	if len(ds) == n || maxWait <= 0 {
		return ds
	}
	timer := time.NewTimer(maxWait)
	defer timer.Stop()
	for len(ds) < n {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return ds
			}
			ds = append(ds, d)
		case <-timer.C:
			return ds
		case <-ctx.Done():
			return ds
		}
	}
	return ds
}

// HandleBatch processes ds together and acknowledges each as its outcome
// says: ProcessBatch, then SettleBatch. It returns the outcomes, in the
// order of ds.
func (c *Consumer) HandleBatch(ctx context.Context, ds []amqp.Delivery) []consumer.Result {
	results := c.ProcessBatch(ctx, ds)
	c.SettleBatch(ctx, ds, results)
	return results
}

// ProcessBatch decides what becomes of each of ds, as Process decides one,
// and returns the outcomes in the order of ds, without acknowledging them:
// SettleBatch does, once it has returned. In atomic mode on store/postgres,
// the batch is deduplicated in one round trip and its handlers run in one
// transaction that commits once, each message's writes apart from the
// others' (consumer.Consumer.ProcessBatch); in two-phase mode one statement
// reserves the batch's ids, and each message is then processed as Process
// does; on another store its messages are processed one at a time. A message that ended in a final failure or was
// refused goes to the dead-letter hook (WithDeadLetter); if the hook fails,
// its Result's action is Nak.
func (c *Consumer) ProcessBatch(ctx context.Context, ds []amqp.Delivery) []consumer.Result {
	results := make([]consumer.Result, len(ds))
	cds := make([]consumer.Delivery, 0, len(ds))
	at := make([]int, 0, len(ds)) // the delivery of each consumer.Delivery
	for i, d := range ds {
		cd, err := c.delivery(d)
		if err != nil {
			results[i] = c.core.Refuse(ctx, err)
			continue
		}
		cds = append(cds, cd)
		at = append(at, i)
	}
	rs := c.core.ProcessBatch(ctx, cds, func(ctx context.Context, j int) error { return c.h(ctx, ds[at[j]]) })
	for j, i := range at {
		results[i] = c.busy(rs[j])
	}
	for i, d := range ds {
		results[i] = c.core.DeadLetter(ctx, results[i], c.deadLetter(d))
	}
	return results
}

// SettleBatch tells RabbitMQ what ProcessBatch decided for each of ds, as
// Settle does one, but without holding the others back: it acknowledges and
// rejects at once, then negative-acknowledges each of the others once its
// Result.Delay has passed (or ctx is done), the shortest first. It returns
// after the longest delay.
func (c *Consumer) SettleBatch(ctx context.Context, ds []amqp.Delivery, results []consumer.Result) {
	var later []int
	for i, d := range ds {
		switch results[i].Action {
		case consumer.Ack, consumer.Reject:
			c.Settle(ctx, d, results[i])
		default:
			later = append(later, i)
		}
	}
	slices.SortStableFunc(later, func(a, b int) int { return cmp.Compare(results[a].Delay, results[b].Delay) })
	start := time.Now()
	for _, i := range later {
		res := results[i]
		res.Delay -= time.Since(start) // Settle waits for what is left of it
		c.Settle(ctx, ds[i], res)
	}
}
