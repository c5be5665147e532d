package idemamqp_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/busystore"
)

// A message is processed once: the same message published again is
// acknowledged without running the handler.
func TestProcessedOnce(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, nil)
			st, copts := b.new(t)
			var runs atomic.Int32
			c := f.consumer(st, copts, func(ctx context.Context, d amqp.Delivery) error {
				runs.Add(1)
				return nil
			})
			id, body := f.secret("id"), f.secret("body")
			for range 2 {
				f.publish("", amqp.Publishing{MessageId: id, Body: []byte(body)})
			}
			_, ds := f.consume("", 2)
			handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
			handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
			if n := runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times; want once", n)
			}
		})
	}
}

// A final failure is recorded, acknowledged and dead-lettered by the hook;
// every later delivery of its id goes to the hook again without running
// the handler, and a failing hook has the message redelivered.
func TestFinalFailure(t *testing.T) {
	for _, b := range backends {
		for _, tc := range []struct {
			name string
			err  error
		}{
			{"Final", consumer.Final(errors.New("card declined"))},
			{"FailedPrecondition", status.Error(codes.FailedPrecondition, "card declined")},
		} {
			t.Run(b.name+"/"+tc.name, func(t *testing.T) {
				t.Parallel()
				f := newFixture(t, nil)
				st, copts := b.new(t)
				var runs atomic.Int32
				dl := &hook{}
				c := f.consumer(st, copts, func(ctx context.Context, d amqp.Delivery) error {
					runs.Add(1)
					return tc.err
				}, consumer.WithDeadLetter(dl.deadLetter))
				p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))}
				f.publish("", p)
				_, ds := f.consume("", 1)

				res := handle(t, c, next(t, ds), consumer.Failed, consumer.Ack)
				if !res.DeadLetter || !errors.Is(res.Err, tc.err) {
					t.Errorf("Result = %+v; want a dead letter with the handler's error", res)
				}
				if len(dl.errs) != 1 || !errors.Is(dl.errs[0], tc.err) {
					t.Fatalf("the hook got %v; want the handler's error once", dl.errs)
				}

				// Published again: the hook, not the handler.
				f.publish("", p)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
				if len(dl.errs) != 2 || !errors.Is(dl.errs[1], consumer.ErrFailedBefore) {
					t.Fatalf("the hook got %v; want ErrFailedBefore second", dl.errs)
				}

				// The hook fails: RabbitMQ redelivers the message, to the hook.
				dl.fail = 1
				f.publish("", p)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Nak)
				d := next(t, ds)
				if !d.Redelivered {
					t.Error("the message after a failed hook is not marked redelivered")
				}
				handle(t, c, d, consumer.Duplicate, consumer.Ack)
				if len(dl.errs) != 4 {
					t.Errorf("the hook ran %d times; want 4", len(dl.errs))
				}
				if n := runs.Load(); n != 1 {
					t.Errorf("the handler ran %d times; want once", n)
				}
			})
		}
	}
}

// A transient error releases the message's id and requeues it after a
// backoff, which grows on a quorum queue, which counts deliveries, and not
// on a classic queue, which does not; the redelivery runs the handler again.
func TestTransient(t *testing.T) {
	for _, b := range backends {
		for _, queueType := range []string{"classic", "quorum"} {
			t.Run(b.name+"/"+queueType, func(t *testing.T) {
				t.Parallel()
				f := newFixture(t, amqp.Table{"x-queue-type": queueType})
				st, copts := b.new(t)
				var runs atomic.Int32
				c := f.consumer(st, copts, func(ctx context.Context, d amqp.Delivery) error {
					if runs.Add(1) <= 2 {
						return errors.New("the ledger is down")
					}
					return nil
				})
				p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))}
				f.publish("", p)
				_, ds := f.consume("", 1)

				first := handle(t, c, next(t, ds), consumer.Retry, consumer.Nak)
				d := next(t, ds)
				if !d.Redelivered {
					t.Error("the requeued message is not marked redelivered")
				}
				second := handle(t, c, d, consumer.Retry, consumer.Nak)
				handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
				if n := runs.Load(); n != 3 {
					t.Errorf("the handler ran %d times; want 3", n)
				}
				// WithBackoff(10ms, …): 10ms less up to a quarter for an
				// unknown or first attempt, 20ms less up to a quarter for
				// the second.
				if first.Delay > 10*time.Millisecond {
					t.Errorf("first delay %v; want at most 10ms", first.Delay)
				}
				if grew := second.Delay >= 15*time.Millisecond; grew != (queueType == "quorum") {
					t.Errorf("second delay %v on a %s queue", second.Delay, queueType)
				}

				f.publish("", p)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
			})
		}
	}
}

// A message without an id, or whose id came first with another body, is
// rejected without running, and so dead-lettered by RabbitMQ to the queue's
// dead-letter exchange.
func TestRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		want error
		// first is published before the refused message, and processed.
		first func(p amqp.Publishing) *amqp.Publishing
		// refused is the message refused.
		refused func(p amqp.Publishing) amqp.Publishing
	}{
		{
			name:    "no id",
			want:    consumer.ErrNoID,
			refused: func(p amqp.Publishing) amqp.Publishing { p.MessageId = ""; return p },
		},
		{
			name:    "reused id",
			want:    consumer.ErrReusedID,
			first:   func(p amqp.Publishing) *amqp.Publishing { return &p },
			refused: func(p amqp.Publishing) amqp.Publishing { p.Body = append(p.Body, '!'); return p },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conn := amqptest.Conn(t)
			dlx := amqptest.Exchange(t, conn)
			dlq := amqptest.Queue(t, conn, nil)
			bind := amqptest.Channel(t, conn)
			if err := bind.QueueBind(dlq, "", dlx, false, nil); err != nil {
				t.Fatal(err)
			}
			f := newFixture(t, amqp.Table{"x-dead-letter-exchange": dlx})
			var runs atomic.Int32
			dl := &hook{}
			c := f.consumer(memory.New(), nil, func(ctx context.Context, d amqp.Delivery) error {
				runs.Add(1)
				return nil
			}, consumer.WithDeadLetter(dl.deadLetter))
			p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))}
			_, ds := f.consume("", 1)
			if tc.first != nil {
				f.publish("", *tc.first(p))
				handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
			}
			refused := tc.refused(p)
			f.publish("", refused)
			res := handle(t, c, next(t, ds), consumer.Rejected, consumer.Reject)
			if !errors.Is(res.Err, tc.want) || !res.DeadLetter {
				t.Errorf("Result = %+v; want a dead letter for %v", res, tc.want)
			}
			if len(dl.errs) != 1 || !errors.Is(dl.errs[0], tc.want) {
				t.Errorf("the hook got %v; want %v once", dl.errs, tc.want)
			}
			want := int32(0)
			if tc.first != nil {
				want = 1
			}
			if n := runs.Load(); n != want {
				t.Errorf("the handler ran %d times; want %d", n, want)
			}

			dch, dead := f.consume(dlq, 1)
			d := next(t, dead)
			if string(d.Body) != string(refused.Body) || d.MessageId != refused.MessageId {
				t.Error("the dead-letter queue holds another message than the refused one")
			}
			if reason, _ := d.Headers["x-first-death-reason"].(string); reason != "rejected" {
				t.Errorf("x-first-death-reason %q; want rejected", reason)
			}
			if err := d.Ack(false); err != nil {
				t.Fatal(err)
			}
			dch.Close()
			amqptest.Empty(t, conn, dlq)
		})
	}
}

// In atomic mode on PostgreSQL, the handler's write commits with the
// message's record: once for a message processed, and not at all for a
// message that failed, for good or for now.
func TestAtomic(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	st, pool := postgresStore(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (id bigserial PRIMARY KEY, outcome text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var transient atomic.Int32
	c := f.consumer(st, []consumer.Option{consumer.WithAtomic()}, func(ctx context.Context, d amqp.Delivery) error {
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			return consumer.Final(errors.New("no transaction in the context"))
		}
		outcome := d.Headers["outcome"].(string)
		if _, err := tx.Exec(ctx, `INSERT INTO effects (outcome) VALUES ($1)`, outcome); err != nil {
			return err
		}
		switch outcome {
		case "final":
			return consumer.Final(errors.New("declined"))
		case "transient":
			if transient.Add(1) == 1 {
				return errors.New("try again")
			}
		}
		return nil
	})
	effects := func(outcome string) int {
		var n int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM effects WHERE outcome = $1`, outcome).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	_, ds := f.consume("", 1)
	for _, tc := range []struct {
		outcome string
		want    []consumer.Outcome // each delivery's, the last acknowledged
		effects int
	}{
		{"ok", []consumer.Outcome{consumer.Processed}, 1},
		{"final", []consumer.Outcome{consumer.Failed}, 0},
		{"transient", []consumer.Outcome{consumer.Retry, consumer.Processed}, 1},
	} {
		p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body")), Headers: amqp.Table{"outcome": tc.outcome}}
		f.publish("", p)
		for i, want := range tc.want {
			action := consumer.Ack
			if i < len(tc.want)-1 {
				action = consumer.Nak
			}
			handle(t, c, next(t, ds), want, action)
		}
		f.publish("", p)
		res := handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
		if res.DeadLetter != (tc.outcome == "final") {
			t.Errorf("%s: the duplicate's DeadLetter is %v", tc.outcome, res.DeadLetter)
		}
		if n := effects(tc.outcome); n != tc.effects {
			t.Errorf("%s: %d effects committed; want %d", tc.outcome, n, tc.effects)
		}
	}
}

// Two workers, on two channels with a prefetch of several, race on copies of
// one message: the handler runs once, and every copy is acknowledged.
func TestWorkers(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, nil)
			st, copts := b.new(t)
			var (
				runs    atomic.Int32
				busy    = make(chan struct{}) // closed once a copy found the first in progress
				sawBusy sync.Once
			)
			c := f.consumer(st, copts, func(ctx context.Context, d amqp.Delivery) error {
				runs.Add(1)
				// The run holds its id until another worker's copy has
				// found it in progress, however the machine schedules the
				// workers (or for at most a while, should none ever).
				select {
				case <-busy:
				case <-time.After(5 * time.Second):
				}
				return nil
			})
			const copies = 10
			p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))}
			for range copies {
				f.publish("", p)
			}
			results := make(chan consumer.Result, 100)
			var chans []*amqp.Channel
			var wg sync.WaitGroup
			for range 2 {
				ch, ds := f.consume("", 4)
				chans = append(chans, ch)
				wg.Go(func() {
					for d := range ds {
						results <- c.Handle(t.Context(), d)
					}
				})
			}
			counts := map[consumer.Outcome]int{}
			timeout := time.After(30 * time.Second)
			for acked := 0; acked < copies; {
				select {
				case res := <-results:
					counts[res.Outcome]++
					if res.Outcome == consumer.Busy {
						sawBusy.Do(func() { close(busy) })
					}
					if res.Action == consumer.Ack {
						acked++
					}
				case <-timeout:
					t.Fatalf("after 30s, %d of %d copies acknowledged: %v", acked, copies, counts)
				}
			}
			for _, ch := range chans {
				ch.Close()
			}
			wg.Wait()
			if n := runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times; want once", n)
			}
			if counts[consumer.Processed] != 1 || counts[consumer.Duplicate] != copies-1 {
				t.Errorf("outcomes %v; want 1 processed and %d duplicates", counts, copies-1)
			}
			// A copy that finds the first in progress is requeued after a
			// delay, in either mode.
			if counts[consumer.Busy] == 0 {
				t.Errorf("outcomes %v; want some busy on the way", counts)
			}
		})
	}
}

// A tenant scopes ids, and CloudEventsID reads a CloudEvent's id.
func TestCloudEventsTenant(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	var runs atomic.Int32
	c := f.consumer(memory.New(), nil, func(ctx context.Context, d amqp.Delivery) error {
		runs.Add(1)
		return nil
	}, consumer.WithMessageID(idemamqp.CloudEventsID), consumer.WithMessageTenant(func(d amqp.Delivery) (string, error) {
		s, _ := d.Headers["tenant"].(string)
		return s, nil
	}))
	id, body := f.secret("id"), []byte(f.secret("body"))
	acme, globex := f.secret("tenant"), f.secret("tenant")
	_, ds := f.consume("", 1)
	for _, tc := range []struct {
		headers amqp.Table
		want    consumer.Outcome
	}{
		{amqp.Table{"cloudEvents:id": id, "tenant": acme}, consumer.Processed},
		{amqp.Table{"cloudEvents_id": id, "tenant": acme}, consumer.Duplicate},
		{amqp.Table{"cloudEvents:id": id, "tenant": globex}, consumer.Processed},
	} {
		f.publish("", amqp.Publishing{Headers: tc.headers, Body: body})
		handle(t, c, next(t, ds), tc.want, consumer.Ack)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times; want twice, once for each tenant", n)
	}
}

// A worker that waits out a backoff before it requeues a message stops
// waiting when its context is done, and requeues the message at once: a
// shutdown is not held up by the backoffs in progress.
func TestNakCancelled(t *testing.T) {
	t.Parallel()
	f := newFixture(t, nil)
	var runs atomic.Int32
	c := f.consumer(memory.New(), []consumer.Option{consumer.WithBackoff(time.Minute, time.Minute)}, func(ctx context.Context, d amqp.Delivery) error {
		if runs.Add(1) == 1 {
			return errors.New("the ledger is down")
		}
		return nil
	})
	f.publish("", amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))})
	_, ds := f.consume("", 1)

	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	if res := c.Handle(ctx, next(t, ds)); res.Outcome != consumer.Retry || res.Delay < 30*time.Second {
		t.Fatalf("Handle = %v; want a retry after about a minute", res)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Handle took %v after its context was done", took)
	}
	handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
}

// TestDeliveryLimit: on a quorum queue with an x-delivery-limit, the last
// delivery of a message that keeps failing goes to the dead-letter hook and
// is acknowledged, rather than dropped by RabbitMQ in silence.
func TestDeliveryLimit(t *testing.T) {
	f := newFixture(t, amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(2)})
	h := &hook{}
	var runs atomic.Int32
	c := f.consumer(memory.New(), nil, func(context.Context, amqp.Delivery) error {
		runs.Add(1)
		return errors.New("the ledger is down")
	}, consumer.WithDeadLetter(h.deadLetter))
	f.publish("", amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))})
	_, ds := f.consume("", 1)
	handle(t, c, next(t, ds), consumer.Retry, consumer.Nak)
	handle(t, c, next(t, ds), consumer.Retry, consumer.Nak)
	res := handle(t, c, next(t, ds), consumer.Retry, consumer.Ack)
	if !res.DeadLetter || !errors.Is(res.Err, consumer.ErrLastDelivery) || len(h.errs) != 1 {
		t.Fatalf("last delivery: %+v, %d dead letters; want it dead-lettered once", res, len(h.errs))
	}
	if n := runs.Load(); n != 3 {
		t.Fatalf("the handler ran %d times; want 3", n)
	}
}

// TestBusyRequeued: a copy of a message in progress on another worker is
// requeued after at most a second on a queue without a delivery limit,
// though the run it waits for holds its id for a minute; on a quorum queue
// with an x-delivery-limit, whose deliveries a requeue spends, it is held
// for the rest of that run's lease. Once the run ends, the copy is a
// duplicate.
func TestBusyRequeued(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  amqp.Table
		lease time.Duration // the engine's; its default, a minute, if zero
	}{
		{"no limit", nil, 0},
		{"limit", amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(5)}, 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, tc.args)
			st := busystore.New(memory.New())
			var eopts []engine.Option
			if tc.lease > 0 {
				eopts = append(eopts, engine.WithLease(tc.lease))
			}
			started, release := make(chan struct{}), make(chan struct{})
			var runs atomic.Int32
			c := f.consumerWith(st, eopts, nil, func(context.Context, amqp.Delivery) error {
				if runs.Add(1) == 1 {
					close(started)
					<-release
				}
				return nil
			})
			p := amqp.Publishing{MessageId: f.secret("id"), Body: []byte(f.secret("body"))}
			f.publish("", p)
			f.publish("", p)
			_, dsA := f.consume("", 1)
			_, dsB := f.consume("", 1)
			first := make(chan consumer.Result, 1)
			d := next(t, dsA)
			go func() { first <- c.Handle(t.Context(), d) }()
			<-started

			// The copy finds the first in progress (busystore.Busy); the
			// first run then ends, and the copy is requeued after its
			// delay all the same.
			dup := next(t, dsB)
			start := time.Now()
			second := make(chan consumer.Result, 1)
			go func() { second <- c.Handle(busystore.LastDelivery(t.Context()), dup) }()
			select {
			case <-st.Busy():
			case <-time.After(10 * time.Second):
				t.Fatal("the copy did not find the message in progress")
			}
			close(release)
			if res := <-first; res.Outcome != consumer.Processed {
				t.Fatalf("the first run: %v, want processed", res)
			}
			res := <-second
			took := time.Since(start)
			if res.Outcome != consumer.Busy || res.Action != consumer.Nak {
				t.Fatalf("the copy: %v, want busy, requeued", res)
			}
			if tc.lease == 0 {
				if res.Delay != time.Second || took < time.Second || took > 10*time.Second {
					t.Errorf("the copy was requeued after %v, its delay %v; want after a second (the Result saying so), though the run's lease ran for a minute", took, res.Delay)
				}
			} else if res.Delay < time.Second || took < res.Delay {
				t.Errorf("the copy was requeued after %v, its delay %v; want after the rest of the run's lease", took, res.Delay)
			}
			// RabbitMQ requeues the copy to either worker.
			var again amqp.Delivery
			select {
			case again = <-dsA:
			case again = <-dsB:
			case <-time.After(5 * time.Second):
				t.Fatal("the copy was not delivered again within 5s")
			}
			handle(t, c, again, consumer.Duplicate, consumer.Ack)
			if n := runs.Load(); n != 1 {
				t.Errorf("the handler ran %d times; want once", n)
			}
		})
	}
}
