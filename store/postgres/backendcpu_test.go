package postgres_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// BenchmarkBackendCPU measures what PostgreSQL itself spends on a new key: the
// CPU time of the backend process, read from /proc (so the database must run
// on this machine), per call, which no other process on a shared machine
// inflates as it does latency. Each variant has a pool of one connection, so
// one backend, and the variants run interleaved:
//   - bare: the business write alone, one autocommitted INSERT;
//   - minimal-atomic: the design's minimal SQL in one transaction, in the
//     store's round trips: BEGIN with an insert-or-nothing, the business
//     INSERT, then a plain update by key with COMMIT;
//   - atomic: the store's Begin, the business INSERT in its transaction,
//     and Commit;
//   - minimal-two-phase and two-phase: the same, each write committing on
//     its own (Reserve, the INSERT, Complete).
//
// It reports each variant's backend CPU per call and the store's ratio to
// the minimal SQL: the target is at most 1.10.
func BenchmarkBackendCPU(b *testing.B) {
	schema, _ := chargesSchema(b, postgres.DefaultTable, "baseline_keys")
	ctx := context.Background()
	// As in a gRPC handler, pgx watches the context of every statement.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	one := func() (*pgxpool.Pool, int) {
		pool := pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.MinConns, c.MaxConns = 1, 1 })
		var pid int
		if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			b.Fatal(err)
		}
		if _, err := pgtest.BackendCPU(pid); err != nil {
			b.Skipf("the backend's CPU cannot be read here (is PostgreSQL on another machine?): %v", err)
		}
		return pool, pid
	}
	charge := func(ctx context.Context, db postgres.Querier, variant string, i int) error {
		_, err := db.Exec(ctx, `INSERT INTO charges (tenant, id, amount, create_time) VALUES ($1, $2, $3, $4)`,
			"acme", variant+"-"+strconv.Itoa(i), int64(100), time.Now())
		return err
	}
	fp := store.Fingerprint{1}
	r := func(variant string, i int) store.Reservation {
		return store.Reservation{Key: benchKey(variant, i), Fingerprint: fp, Lease: time.Minute, Retention: 24 * time.Hour}
	}
	type variant struct {
		name string
		run  func(pool *pgxpool.Pool, i int) error
	}
	variants := []variant{
		{"bare", func(pool *pgxpool.Pool, i int) error { return charge(ctx, pool, "bare", i) }},
		{"minimal-atomic", func(pool *pgxpool.Pool, i int) error {
			conn, err := pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			key := r("minimal-atomic", i).Key
			var token int64
			begin := &pgx.Batch{}
			begin.Queue("BEGIN")
			begin.Queue(minimalReserve, key[:], fp[:]).QueryRow(func(row pgx.Row) error { return row.Scan(&token) })
			if err := conn.SendBatch(ctx, begin).Close(); err != nil {
				return err
			}
			if err := charge(ctx, conn, "minimal-atomic", i); err != nil {
				return err
			}
			commit := &pgx.Batch{}
			commit.Queue(minimalComplete, key[:], token, outcome)
			commit.Queue("COMMIT")
			return conn.SendBatch(ctx, commit).Close()
		}},
		{"atomic", nil},
		{"minimal-two-phase", func(pool *pgxpool.Pool, i int) error {
			key := r("minimal-two-phase", i).Key
			var token int64
			if err := pool.QueryRow(ctx, minimalReserve, key[:], fp[:]).Scan(&token); err != nil {
				return err
			}
			if err := charge(ctx, pool, "minimal-two-phase", i); err != nil {
				return err
			}
			_, err := pool.Exec(ctx, minimalComplete, key[:], token, outcome)
			return err
		}},
		{"two-phase", nil},
	}
	pools := make([]*pgxpool.Pool, len(variants))
	pids := make([]int, len(variants))
	stores := make([]*postgres.Store, len(variants))
	for i := range variants {
		pools[i], pids[i] = one()
		stores[i] = newStore(b, pools[i])
	}
	variants[2].run = func(pool *pgxpool.Pool, i int) error {
		st := stores[2]
		res, tx, err := st.Begin(ctx, r("atomic", i))
		if err != nil || res.State != store.Acquired {
			return fmt.Errorf("begin: %v, %v", res.State, err)
		}
		hctx := tx.HandlerContext(ctx)
		q, _ := postgres.TxFromContext(hctx)
		if err := charge(hctx, q, "atomic", i); err != nil {
			tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx, outcome, true)
	}
	variants[4].run = func(pool *pgxpool.Pool, i int) error {
		st := stores[4]
		res, err := st.Reserve(ctx, r("two-phase", i))
		if err != nil || res.State != store.Acquired {
			return fmt.Errorf("reserve: %v, %v", res.State, err)
		}
		if err := charge(ctx, pool, "two-phase", i); err != nil {
			return err
		}
		return st.Complete(ctx, r("two-phase", i).Key, res.Token, outcome)
	}
	for k, v := range variants { // prepare the statements
		if err := v.run(pools[k], -1); err != nil {
			b.Fatalf("%s: %v", v.name, err)
		}
	}
	spent := make([]time.Duration, len(variants))
	n := 0
	for b.Loop() {
		for j := range variants {
			k := (n + j) % len(variants)
			before, _ := pgtest.BackendCPU(pids[k])
			if err := variants[k].run(pools[k], n); err != nil {
				b.Fatalf("%s: %v", variants[k].name, err)
			}
			after, _ := pgtest.BackendCPU(pids[k])
			spent[k] += after - before
		}
		n++
	}
	per := make([]float64, len(variants))
	for k, v := range variants {
		per[k] = float64(spent[k].Nanoseconds()) / float64(n)
		b.ReportMetric(per[k], v.name+"-cpu-ns/op")
	}
	b.ReportMetric(per[2]/per[1], "atomic/minimal-atomic")
	b.ReportMetric(per[4]/per[3], "two-phase/minimal-two-phase")
	b.ReportMetric(per[2]/per[0], "atomic/bare")
}

// The design's minimal SQL of a new key, as in BenchmarkStoreVsBaseline.
const (
	minimalReserve = `INSERT INTO baseline_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
		VALUES ($1, $2, 'in_progress', nextval('baseline_keys_token_seq'), now() + interval '1 minute', now(), now() + interval '1 day')
		ON CONFLICT DO NOTHING RETURNING token`
	minimalComplete = `UPDATE baseline_keys SET state = 'completed', outcome = $3 WHERE key = $1 AND token = $2`
)
