package idemnats_test

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
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/natstest"
)

// takeBatch gathers exactly n messages of it with NextBatch, however they
// arrive.
func takeBatch(t *testing.T, it jetstream.MessagesContext, n int) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var got []jetstream.Msg
	for len(got) < n {
		batch, err := idemnats.NextBatch(ctx, it, n-len(got), 5*time.Millisecond)
		if err != nil {
			t.Fatalf("%d of %d messages: %v", len(got), n, err)
		}
		got = append(got, batch...)
	}
	return got
}

// A batch fetched from JetStream answers each message as it would alone: an
// id twice in the batch and an id processed before are duplicates, a final
// failure is recorded and dead-lettered, a transient one negative-acked and
// processed when redelivered, the rest processed; in atomic mode only the
// processed messages' writes commit. The ids are in the header "order-id",
// so that JetStream, which drops a repeated Nats-Msg-Id, delivers both
// copies of one.
func TestBatch(t *testing.T) {
	_, js := natstest.Connect(t)
	for _, mode := range []string{"memory", "postgres", "postgres-atomic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			var (
				st    store.Store = memory.New()
				pool  *pgxpool.Pool
				copts []consumer.Option
			)
			if mode != "memory" {
				pool = pgtest.Pool(t, pgtest.Schema(t))
				if err := postgres.Migrate(t.Context(), pool); err != nil {
					t.Fatal(err)
				}
				if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (n serial, name text NOT NULL)`); err != nil {
					t.Fatal(err)
				}
				var err error
				if st, err = postgres.New(pool); err != nil {
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
			orderID := func(msg jetstream.Msg) (string, error) { return msg.Headers().Get("order-id"), nil }
			r := newRig(t, js, st, func(ctx context.Context, msg jetstream.Msg) error {
				name, _ := orderID(msg)
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
			}, nil, append(copts, consumer.WithMessageID(orderID))...)
			publish := func(name string) { r.publish("", "body of "+name, "order-id", name) }

			it, err := r.cons.Messages(jetstream.PullMaxMessages(16))
			if err != nil {
				t.Fatal(err)
			}
			defer it.Stop()
			publish("old")
			r.c.HandleBatch(t.Context(), takeBatch(t, it, 1))

			order := []string{"a", "old", "b", "final", "a", "transient", "c"}
			for _, name := range order {
				publish(name)
			}
			batch := takeBatch(t, it, len(order))
			results := r.c.HandleBatch(t.Context(), batch)
			got := map[string][]consumer.Outcome{}
			for i, msg := range batch {
				name, _ := orderID(msg)
				got[name] = append(got[name], results[i].Outcome)
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
			if len(r.dead) != 1 {
				t.Fatalf("dead letters %v, want the final failure's", r.dead)
			}
			// The transient failure comes back, and is processed.
			redelivered := takeBatch(t, it, 1)
			if name, _ := orderID(redelivered[0]); name != "transient" {
				t.Fatalf("redelivered %q, want the transient failure", name)
			}
			if rs := r.c.HandleBatch(t.Context(), redelivered); rs[0].Outcome != consumer.Processed {
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
			r.settled()
		})
	}
}
