package idemamqp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// take gathers exactly n deliveries of ds with NextBatch, however they
// arrive.
func take(t *testing.T, ds <-chan amqp.Delivery, n int) []amqp.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var got []amqp.Delivery
	for len(got) < n {
		batch := idemamqp.NextBatch(ctx, ds, n-len(got), 5*time.Millisecond)
		if batch == nil {
			t.Fatalf("only %d of %d deliveries", len(got), n)
		}
		got = append(got, batch...)
	}
	return got
}

// A batch taken from a prefetch answers each message as it would alone:
// an id twice in the batch and an id processed before are duplicates, a
// final failure is recorded and dead-lettered, a transient one requeued
// and processed when redelivered, the rest processed; in atomic mode only
// the processed messages' writes commit.
func TestBatch(t *testing.T) {
	for _, mode := range []string{"memory", "postgres", "postgres-atomic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, amqp.Table{"x-queue-type": "quorum"})
			var (
				st    store.Store = memory.New()
				pool  *pgxpool.Pool
				copts []consumer.Option
			)
			if mode != "memory" {
				st, pool = postgresStore(t)
				if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (n serial, name text NOT NULL)`); err != nil {
					t.Fatal(err)
				}
			}
			if mode == "postgres-atomic" {
				copts = []consumer.Option{consumer.WithAtomic()}
			}
			var (
				mu       sync.Mutex
				runs     = map[string]int{}
				failOnce = true
			)
			ids := map[string]string{}
			for _, name := range []string{"a", "b", "old", "final", "transient", "c"} {
				ids[name] = f.secret("id-" + name)
			}
			names := map[string]string{}
			for name, id := range ids {
				names[id] = name
			}
			dl := &hook{}
			c := f.consumer(st, copts, func(ctx context.Context, d amqp.Delivery) error {
				name := names[d.MessageId]
				mu.Lock()
				runs[name]++
				mu.Unlock()
				if tx, ok := postgres.TxFromContext(ctx); ok {
					if _, err := tx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
						return err
					}
				}
				switch {
				case name == "final":
					return status.Error(codes.FailedPrecondition, "declined")
				case name == "transient" && failOnce:
					failOnce = false
					return errors.New("down")
				}
				return nil
			}, consumer.WithDeadLetter(dl.deadLetter))
			publish := func(name string) {
				f.publish("", amqp.Publishing{MessageId: ids[name], Body: []byte("body of " + name), DeliveryMode: amqp.Persistent})
			}
			publish("old")
			_, ds := f.consume("", 16)
			handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)

			order := []string{"a", "old", "b", "final", "a", "transient", "c"}
			for _, name := range order {
				publish(name)
			}
			batch := take(t, ds, len(order))
			results := c.HandleBatch(t.Context(), batch)
			got := map[string][]consumer.Outcome{}
			for i, d := range batch {
				got[names[d.MessageId]] = append(got[names[d.MessageId]], results[i].Outcome)
			}
			want := map[string][]consumer.Outcome{
				"a":         {consumer.Processed, consumer.Duplicate},
				"old":       {consumer.Duplicate},
				"b":         {consumer.Processed},
				"final":     {consumer.Failed},
				"transient": {consumer.Retry},
				"c":         {consumer.Processed},
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("outcomes %v, want %v", got, want)
			}
			if len(dl.errs) != 1 {
				t.Fatalf("dead letters %v, want the final failure's", dl.errs)
			}
			// The transient failure comes back, and is processed.
			d := next(t, ds)
			if names[d.MessageId] != "transient" || !d.Redelivered {
				t.Fatalf("redelivered %q (redelivered %v), want the transient failure", names[d.MessageId], d.Redelivered)
			}
			if rs := c.HandleBatch(t.Context(), []amqp.Delivery{d}); rs[0].Outcome != consumer.Processed {
				t.Fatalf("the redelivery: %v", rs[0])
			}
			if want := map[string]int{"a": 1, "old": 1, "b": 1, "final": 1, "transient": 2, "c": 1}; fmt.Sprint(runs) != fmt.Sprint(want) {
				t.Fatalf("runs %v, want %v", runs, want)
			}
			if mode == "postgres-atomic" {
				rows, _ := pool.Query(t.Context(), `SELECT name FROM effects ORDER BY n`)
				effects, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					t.Fatal(err)
				}
				if want := []string{"old", "a", "b", "c", "transient"}; !slices.Equal(effects, want) {
					t.Fatalf("effects %v, want %v", effects, want)
				}
			}
		})
	}
}

// TestBatchSettled: HandleBatch acknowledges and rejects a batch's messages
// at once, then requeues each that failed for now once its own delay has
// passed, counted from the same start, the shortest first: a message
// waiting out its backoff holds back neither the others' acknowledgements
// nor their requeueing. The quorum queue counts deliveries, so a message on
// its second delivery backs off longer than one on its first.
func TestBatchSettled(t *testing.T) {
	t.Parallel()
	f := newFixture(t, amqp.Table{"x-queue-type": "quorum"})
	ids := map[string]string{}
	names := map[string]string{}
	for _, name := range []string{"slow", "quick", "ok", "next1", "next2"} {
		ids[name] = f.secret("id-" + name)
		names[ids[name]] = name
	}
	var mu sync.Mutex
	runs := map[string]int{}
	dl := &hook{}
	// WithBackoff(1s, …): 0.75s to 1s after a first delivery, 1.5s to 2s
	// after a second.
	c := f.consumer(memory.New(), []consumer.Option{consumer.WithBackoff(time.Second, 10*time.Second)}, func(_ context.Context, d amqp.Delivery) error {
		name := names[d.MessageId]
		mu.Lock()
		runs[name]++
		n := runs[name]
		mu.Unlock()
		switch {
		case name == "slow" && n <= 2, name == "quick" && n == 1:
			return errors.New("the ledger is down")
		}
		return nil
	}, consumer.WithDeadLetter(dl.deadLetter))
	publish := func(name string) {
		p := amqp.Publishing{MessageId: ids[name], Body: []byte(f.secret("body"))}
		if name == "noid" {
			p.MessageId = ""
		}
		f.publish("", p)
	}
	const prefetch = 4
	_, ds := f.consume("", prefetch)
	publish("slow")
	handle(t, c, next(t, ds), consumer.Retry, consumer.Nak) // its second delivery backs off longer

	for _, name := range []string{"quick", "ok", "noid"} {
		publish(name)
	}
	batch := take(t, ds, prefetch) // slow's second delivery, quick, ok, noid
	// The prefetch is full: these wait for a slot.
	publish("next1")
	publish("next2")

	start := time.Now()
	done := make(chan []consumer.Result, 1)
	go func() { done <- c.HandleBatch(t.Context(), batch) }()
	type arrival struct {
		d  amqp.Delivery
		at time.Duration
	}
	var arrived []arrival
	for range 4 {
		d := next(t, ds)
		arrived = append(arrived, arrival{d, time.Since(start)})
	}
	var results []consumer.Result
	select {
	case results = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("HandleBatch did not return")
	}

	byName := map[string]consumer.Result{}
	for i, d := range batch {
		name := names[d.MessageId]
		if d.MessageId == "" {
			name = "noid"
		}
		byName[name] = results[i]
	}
	for name, want := range map[string][2]any{
		"slow":  {consumer.Retry, consumer.Nak},
		"quick": {consumer.Retry, consumer.Nak},
		"ok":    {consumer.Processed, consumer.Ack},
		"noid":  {consumer.Rejected, consumer.Reject},
	} {
		if res := byName[name]; res.Outcome != want[0] || res.Action != want[1] {
			t.Fatalf("%s: %v, want %v (%v)", name, res, want[0], want[1])
		}
	}
	quick, slow := byName["quick"].Delay, byName["slow"].Delay
	if quick >= slow {
		t.Fatalf("delays: quick %v, slow %v; want the second delivery's longer", quick, slow)
	}
	if len(dl.errs) != 1 || !errors.Is(dl.errs[0], consumer.ErrNoID) {
		t.Fatalf("dead letters %v, want the message without an id's", dl.errs)
	}

	// ok's acknowledgement and noid's rejection freed two slots at once:
	// the waiting messages came before either requeued one.
	var order []string
	for _, a := range arrived {
		order = append(order, names[a.d.MessageId])
	}
	if fmt.Sprint(order[:2]) != "[next1 next2]" && fmt.Sprint(order[:2]) != "[next2 next1]" || order[2] != "quick" || order[3] != "slow" {
		t.Fatalf("deliveries after the batch: %v, want next1 and next2, then quick, then slow", order)
	}
	if at := arrived[2].at; at < quick {
		t.Errorf("quick was requeued after %v, before its delay, %v", at, quick)
	}
	// slow's delay counts from the start, not from quick's requeueing: it
	// came less than its own delay after quick (a gap, not a time since the
	// start, so that a busy machine's slower batch does not count).
	if at, gap := arrived[3].at, arrived[3].at-arrived[2].at; at < slow || gap >= slow {
		t.Errorf("slow was requeued after %v, %v after quick; want after its delay, %v, and less than that after quick", at, gap, slow)
	}

	for _, a := range arrived {
		handle(t, c, a.d, consumer.Processed, consumer.Ack)
	}
	if want := map[string]int{"slow": 3, "quick": 2, "ok": 1, "next1": 1, "next2": 1}; fmt.Sprint(runs) != fmt.Sprint(want) {
		t.Fatalf("runs %v, want %v", runs, want)
	}
}
