package idemnats

import (
	"context"
	"time"

	"github.com/nats-io/nats.go/jetstream"
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
//		c.HandleBatch(ctx, msgs) // c: a consumer.Consumer on New's Broker
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
