package idemkafka_test

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
	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// takeBatch polls exactly n records with NextBatch, however they arrive.
func takeBatch(t *testing.T, r *rig, n int) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) < n {
		rs, err := idemkafka.NextBatch(ctx, r.cl, n-len(got), 0)
		if err != nil {
			t.Fatalf("%d of %d records: %v", len(got), n, err)
		}
		got = append(got, rs...)
	}
	return got
}

// A batch polled from Kafka answers each record as it would alone: an id
// twice in the batch and an id processed before are duplicates, a final
// failure is recorded and dead-lettered, a transient one is processed again
// after its backoff, within the batch, the rest processed; in atomic mode
// only the processed records' writes commit, and every offset is committed
// once the batch is.
func TestBatch(t *testing.T) {
	for _, mode := range []string{"memory", "postgres", "postgres-atomic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			var (
				st    store.Store = memory.New()
				pool  *pgxpool.Pool
				copts []consumer.Option
			)
			if mode != "memory" {
				st, pool = pgStore(t)
				if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (n serial, name text NOT NULL)`); err != nil {
					t.Fatal(err)
				}
			}
			if mode == "postgres-atomic" {
				copts = []consumer.Option{consumer.WithAtomic()}
			}
			var (
				mu       sync.Mutex
				failOnce = true
			)
			r := newRig(t, st, func(ctx context.Context, rec *kgo.Record) error {
				name, _ := idemkafka.MessageID(rec)
				if tx, ok := postgres.TxFromContext(ctx); ok {
					if _, err := tx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
						return err
					}
				}
				mu.Lock()
				defer mu.Unlock()
				switch {
				case name == "final":
					return status.Error(codes.FailedPrecondition, "declined")
				case name == "transient" && failOnce:
					failOnce = false
					return errors.New("down")
				}
				return nil
			}, nil, copts)
			publish := func(name string) { r.publish(name, "body of "+name) }

			publish("old")
			r.c.HandleBatch(t.Context(), takeBatch(t, r, 1))
			r.cl.AllowRebalance()

			order := []string{"a", "old", "b", "final", "a", "transient", "c"}
			for _, name := range order {
				publish(name)
			}
			batch := takeBatch(t, r, len(order))
			results := r.c.HandleBatch(t.Context(), batch)
			r.cl.AllowRebalance()
			got := map[string][]consumer.Outcome{}
			for i, rec := range batch {
				name, _ := idemkafka.MessageID(rec)
				got[name] = append(got[name], results[i].Outcome)
			}
			want := map[string][]consumer.Outcome{
				"a":         {consumer.Processed, consumer.Duplicate},
				"old":       {consumer.Duplicate},
				"b":         {consumer.Processed},
				"final":     {consumer.Failed},
				"transient": {consumer.Processed}, // on its second attempt
				"c":         {consumer.Processed},
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("outcomes %v, want %v", got, want)
			}
			if dead := r.deadLetters(); len(dead) != 1 {
				t.Fatalf("dead letters %v, want the final failure's", dead)
			}
			if want := map[string]int{"a": 1, "old": 1, "b": 1, "final": 1, "transient": 2, "c": 1}; fmt.Sprint(r.runs) != fmt.Sprint(want) {
				t.Fatalf("runs %v, want %v", r.runs, want)
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
