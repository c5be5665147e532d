package idemamqp_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
)

// TestExpired: a message whose timestamp is older than the retention, and
// whose id has no record, is dead-lettered with consumer.ErrExpired and
// never runs; its id then still runs when sent anew; and a message with a
// recent timestamp, or none, runs as ever.
func TestExpired(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, nil)
			st, copts := b.new(t)
			var runs atomic.Int32
			var dead hook
			c := f.consumer(st, copts, func(context.Context, amqp.Delivery) error {
				runs.Add(1)
				return nil
			}, consumer.WithDeadLetter(dead.deadLetter))
			id, body := f.secret("id"), f.secret("body")
			old := time.Now().Add(-consumer.RecommendedRetention - time.Hour)
			f.publish("", amqp.Publishing{MessageId: id, Body: []byte(body), Timestamp: old})
			f.publish("", amqp.Publishing{MessageId: id, Body: []byte(body), Timestamp: time.Now()})
			f.publish("", amqp.Publishing{MessageId: f.secret("id"), Body: []byte(body)})
			_, ds := f.consume("", 3)
			res := handle(t, c, next(t, ds), consumer.Rejected, consumer.Reject)
			if !errors.Is(res.Err, consumer.ErrExpired) || len(dead.errs) != 1 || !errors.Is(dead.errs[0], consumer.ErrExpired) {
				t.Fatalf("the stale message: %v, dead letters %v; want one, with ErrExpired", res.Err, dead.errs)
			}
			handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
			handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
			if n := runs.Load(); n != 2 {
				t.Errorf("the handler ran %d times; want twice", n)
			}
		})
	}
}
