package idemamqp

import (
	"context"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
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
//		c.HandleBatch(ctx, ds) // c: a consumer.Consumer on New's Broker
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
