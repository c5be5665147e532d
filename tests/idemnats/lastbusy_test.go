package idemnats_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/busystore"
	"github.com/idemkey/idemkey/tests/natstest"
)

// TestLastDeliveryWhileBusy: the first run of a message outlasts the ack
// wait, so JetStream redelivers it until its last delivery (max deliver),
// which finds the id still held by that run; then the run fails for now.
// JetStream delivers the message no more, so the last delivery must not
// leave it to that run: it waits for the run to end, and runs the handler
// itself once the id is released. The message is processed, or, if that
// run fails for now too, dead-lettered: never lost.
func TestLastDeliveryWhileBusy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		again error // the error of the last delivery's run
	}{
		{"processed", nil},
		{"dead-lettered", errors.New("ledger unreachable, again")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, js := natstest.Connect(t)
			stream := natstest.Stream(t, js, jetstream.StreamConfig{})
			name := natstest.Name("c")
			const maxDeliver = 3
			cons, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{
				Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: maxDeliver,
			})
			if err != nil {
				t.Fatal(err)
			}
			st := busystore.New(memory.New())
			logger, logs := logtest.New()
			eng := newEngine(t, st, engine.WithLogger(logger))
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("the consumer's log:\n%s", logs)
				}
			})
			started, release := make(chan struct{}), make(chan struct{})
			var releaseOnce sync.Once
			var runs atomic.Int32
			var mu sync.Mutex
			var dead []error
			keep := consumer.WithDeadLetter(func(_ context.Context, _ jetstream.Msg, err error) error {
				mu.Lock()
				defer mu.Unlock()
				dead = append(dead, err)
				return nil
			})
			// The busy deliveries are redelivered at once, not at the end
			// of the first run's lease (a minute): the test ends well
			// before it.
			b := quickBusy{newBroker(t, stream, cons)}
			c, err := consumer.New(eng, name, b, func(context.Context, jetstream.Msg) error {
				if runs.Add(1) == 1 {
					close(started)
					<-release
					return errors.New("ledger unreachable")
				}
				return tc.again
			}, fast, keep)
			if err != nil {
				t.Fatal(err)
			}
			msg := nats.NewMsg(stream.CachedInfo().Config.Name + ".charges")
			msg.Header.Set(jetstream.MsgIDHeader, "a")
			if _, err := js.PublishMsg(t.Context(), msg); err != nil {
				t.Fatal(err)
			}

			// Each delivery is handled on a goroutine of its own, as on
			// workers of their own: the first run holds its worker.
			type handled struct {
				delivery uint64
				res      consumer.Result
			}
			results := make(chan handled, 10)
			var workers sync.WaitGroup
			cc, err := cons.Consume(func(msg jetstream.Msg) {
				meta, err := msg.Metadata()
				if err != nil {
					t.Error(err)
					return
				}
				ctx := context.Background()
				if meta.NumDelivered >= maxDeliver {
					ctx = busystore.LastDelivery(ctx)
				}
				workers.Go(func() {
					results <- handled{meta.NumDelivered, c.Handle(ctx, msg)}
				})
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				cc.Stop()
				<-cc.Closed()
				releaseOnce.Do(func() { close(release) })
				workers.Wait()
			})

			select {
			case <-started:
			case <-time.After(20 * time.Second):
				t.Fatal("the first delivery did not come")
			}
			select {
			case <-st.Busy():
			case <-time.After(30 * time.Second):
				t.Fatal("the last delivery did not come, or did not find the message in progress")
			}
			releaseOnce.Do(func() { close(release) }) // the first run fails for now

			got := map[uint64]consumer.Result{}
			for got[1].Outcome == 0 || got[maxDeliver].Outcome == 0 {
				select {
				case h := <-results:
					if _, ok := got[h.delivery]; ok {
						t.Fatalf("delivery %d handled twice", h.delivery)
					}
					got[h.delivery] = h.res
				case <-time.After(30 * time.Second):
					t.Fatalf("the first or the last delivery was not handled; handled: %v", got)
				}
			}
			if res := got[1]; res.Outcome != consumer.Retry {
				t.Errorf("delivery 1: %v, want the first run's retry", res)
			}
			if res := got[2]; res.Outcome != consumer.Busy || res.Action != consumer.Nak {
				t.Errorf("delivery 2: %v, want busy, redelivered", res)
			}
			res := got[maxDeliver]
			mu.Lock()
			defer mu.Unlock()
			if tc.again == nil {
				if res.Outcome != consumer.Processed || res.Action != consumer.Ack || res.DeadLetter || len(dead) != 0 {
					t.Fatalf("last delivery: %v (err %v), %d dead letters; want it processed and acknowledged", res, res.Err, len(dead))
				}
			} else if res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrLastDelivery) || !errors.Is(res.Err, tc.again) || len(dead) != 1 {
				t.Fatalf("last delivery: %v (err %v), %d dead letters; want it dead-lettered once and acknowledged", res, res.Err, len(dead))
			}
			if n := runs.Load(); n != 2 {
				t.Fatalf("the handler ran %d times, want twice: the first run, then the last delivery's", n)
			}
		})
	}
}

// quickBusy is a Broker that has JetStream redeliver a message in progress
// elsewhere (Busy) after at most 50ms, whatever the Result's Delay.
type quickBusy struct{ consumer.Broker[jetstream.Msg] }

func (b quickBusy) Settle(ctx context.Context, msgs []jetstream.Msg, results []consumer.Result) error {
	results = slices.Clone(results)
	for i, res := range results {
		if res.Outcome == consumer.Busy {
			results[i].Delay = min(res.Delay, 50*time.Millisecond)
		}
	}
	return b.Broker.Settle(ctx, msgs, results)
}
