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
