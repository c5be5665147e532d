package idemnats

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
)

// NextBatch takes the next batch of at most n messages from it: it waits
// for the first as it.Next does, until ctx is done, then takes the messages
// it holds, and those that arrive within maxWait of the first, up to n. It
// never waits longer for a full batch: a batch is what is there. Its error
// is the first Next's (the iterator stopped or closed, ctx done); a later
// Next's ends the batch, and the next call returns it.
//
// Pass it an iterator of cons.Messages whose buffer holds about a batch or
// two (jetstream.PullMaxMessages(2*n)): JetStream pulls the next messages
// while a batch is processed, and every message in the buffer waits with
// its ack wait running.
//
//	it, err := cons.Messages(jetstream.PullMaxMessages(64))
//	...
//	for {
//		msgs, err := idemnats.NextBatch(ctx, it, 32, 5*time.Millisecond)
//		if err != nil {
//			break
//		}
//		c.HandleBatch(ctx, msgs)
//	}
func NextBatch(ctx context.Context, it jetstream.MessagesContext, n int, maxWait time.Duration) ([]jetstream.Msg, error) {
	first, err := it.Next(jetstream.NextContext(ctx))
	if err != nil {
		return nil, err
	}
	msgs := make([]jetstream.Msg, 1, max(n, 1))
	msgs[0] = first
	end := time.Now().Add(maxWait)
	for len(msgs) < n {
		left := time.Until(end)
		if left <= 0 {
			break
		}
		msg, err := it.Next(jetstream.NextMaxWait(left))
		if err != nil {
			break
		}
		msgs = append(msgs, msg)
	}
	return msgs, nil
}

// HandleBatch processes msgs together and acknowledges each as its outcome
// says: ProcessBatch, then Settle for each. It returns the outcomes, in the
// order of msgs.
func (c *Consumer) HandleBatch(ctx context.Context, msgs []jetstream.Msg) []consumer.Result {
	results := c.ProcessBatch(ctx, msgs)
	for i, msg := range msgs {
		c.Settle(ctx, msg, results[i])
	}
	return results
}

// ProcessBatch decides what becomes of each of msgs, as Process decides
// one, and returns the outcomes in the order of msgs, without
// acknowledging them: Settle each once it has returned. In atomic mode on
// store/postgres, the batch is deduplicated in one round trip and its
// handlers run in one transaction that commits once, each message's writes
// apart from the others' (consumer.Consumer.ProcessBatch); in two-phase
// mode one statement reserves the batch's ids, and each message is then
// processed as Process does; on another store its messages are processed
// one at a time. A message that ended in a final
// failure or was refused goes to the dead-letter hook (WithDeadLetter); if
// the hook fails, its Result's action is Nak.
func (c *Consumer) ProcessBatch(ctx context.Context, msgs []jetstream.Msg) []consumer.Result {
	results := make([]consumer.Result, len(msgs))
	ds := make([]consumer.Delivery, 0, len(msgs))
	at := make([]int, 0, len(msgs)) // the message of each delivery
	for i, msg := range msgs {
		d, err := c.delivery(msg)
		if err != nil {
			results[i] = c.core.Refuse(ctx, err)
			continue
		}
		ds = append(ds, d)
		at = append(at, i)
	}
	rs := c.core.ProcessBatch(ctx, ds, func(ctx context.Context, j int) error { return c.h(ctx, msgs[at[j]]) })
	for j, i := range at {
		results[i] = rs[j]
	}
	for i, msg := range msgs {
		results[i] = c.core.DeadLetter(ctx, results[i], c.deadLetter(msg))
	}
	return results
}
