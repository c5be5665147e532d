package idemamqp_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/busystore"
)

// TestLastDeliveryWhileBusy: a worker's channel closes while its handler
// runs, so RabbitMQ requeues the message to another worker, which finds it
// in progress, until the last delivery its quorum queue's x-delivery-limit
// allows; then the first run fails for now, and cannot even requeue the
// message on its closed channel. The last delivery must not leave the
// message to that run: it waits for the run to end, and runs the handler
// itself once the id is released. The message is processed, or, if that
// run fails for now too, dead-lettered: never lost.
func TestLastDeliveryWhileBusy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		again error // the error of the last delivery's run
	}{
		{"processed", nil},
		{"dead-lettered", errors.New("the ledger is down, again")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const limit = 2 // the third delivery is the last
			f := newFixture(t, amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(limit)})
			st := busystore.New(memory.New())
			dl := &hook{}
			var dlMu sync.Mutex
			started, release := make(chan struct{}), make(chan struct{})
			var releaseOnce sync.Once
			var runs atomic.Int32
			c := f.consumer(st, nil, func(context.Context, amqp.Delivery) error {
				if runs.Add(1) == 1 {
					close(started)
					<-release
					return errors.New("the ledger is down")
				}
				return tc.again
			}, consumer.WithDeadLetter(func(ctx context.Context, d amqp.Delivery, err error) error {
				dlMu.Lock()
				defer dlMu.Unlock()
				return dl.deadLetter(ctx, d, err)
			}))
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("the consumer's log:\n%s", f.logs)
				}
			})
			f.publish("", amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))})

			// The first worker takes the message, and its channel closes
			// while the handler runs: RabbitMQ requeues the message.
			first := make(chan consumer.Result, 1)
			var workers sync.WaitGroup
			var chB *amqp.Channel
			t.Cleanup(func() {
				if chB != nil {
					chB.Close()
				}
				releaseOnce.Do(func() { close(release) })
				workers.Wait()
			})
			chA, dsA := f.consume("", 1)
			d := next(t, dsA)
			workers.Go(func() { first <- c.Handle(context.Background(), d) })
			select {
			case <-started:
			case <-time.After(20 * time.Second):
				t.Fatal("the first run did not start")
			}
			if err := chA.Close(); err != nil {
				t.Fatal(err)
			}

			// A second worker gets its redeliveries.
			type handled struct {
				last bool
				res  consumer.Result
			}
			results := make(chan handled, 10)
			var dsB <-chan amqp.Delivery
			chB, dsB = f.consume("", 1)
			workers.Go(func() {
				for d := range dsB {
					n, _ := d.Headers["x-delivery-count"].(int64)
					last := n >= limit
					var res consumer.Result
					if last {
						res = c.Handle(busystore.LastDelivery(context.Background()), d)
					} else {
						// A busy delivery is requeued at once, not at the
						// end of the first run's lease (a minute), which
						// Settle would wait out on a queue with a delivery
						// limit: a context that ends sooner cuts the wait
						// short, and the test ends well before the lease.
						ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
						res = c.Handle(ctx, d)
						cancel()
					}
					results <- handled{last, res}
				}
			})
			select {
			case <-st.Busy():
			case <-time.After(30 * time.Second):
				t.Fatal("the last delivery did not come, or did not find the message in progress")
			}
			releaseOnce.Do(func() { close(release) }) // the first run fails for now

			var res consumer.Result
			busy := 0
			for res.Outcome == 0 {
				select {
				case h := <-results:
					if h.last {
						res = h.res
					} else if h.res.Outcome == consumer.Busy && h.res.Action == consumer.Nak {
						busy++
					} else {
						t.Fatalf("a redelivery before the last: %v, want busy, requeued", h.res)
					}
				case <-time.After(30 * time.Second):
					t.Fatal("the last delivery was not handled")
				}
			}
			if busy != limit-1 {
				t.Errorf("%d redeliveries before the last found the message busy, want %d", busy, limit-1)
			}
			select {
			case r := <-first:
				if r.Outcome != consumer.Retry {
					t.Errorf("the first run: %v, want a retry", r)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the first run did not end")
			}
			dlMu.Lock()
			defer dlMu.Unlock()
			if tc.again == nil {
				if res.Outcome != consumer.Processed || res.Action != consumer.Ack || res.DeadLetter || len(dl.errs) != 0 {
					t.Fatalf("last delivery: %v (err %v), %d dead letters; want it processed and acknowledged", res, res.Err, len(dl.errs))
				}
			} else if res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrLastDelivery) || !errors.Is(res.Err, tc.again) || len(dl.errs) != 1 {
				t.Fatalf("last delivery: %v (err %v), %d dead letters; want it dead-lettered once and acknowledged", res, res.Err, len(dl.errs))
			}
			if n := runs.Load(); n != 2 {
				t.Fatalf("the handler ran %d times, want twice: the first run, then the last delivery's", n)
			}
		})
	}
}
