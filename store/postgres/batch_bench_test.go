package postgres_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// batchSize is the batch of BenchmarkBatchVsBaseline, the example
// consumer's.
const batchSize = 32

// BenchmarkBatchVsBaseline runs a batch of batchSize atomic calls through
// the store, each writing one row, against the same rows written without
// idemkey, in one transaction (BEGIN, an INSERT per call, COMMIT), and
// against that transaction with each part of the store's batch added by
// hand, interleaved, one batch of each per iteration:
//   - savepoints: a savepoint per call, nested in the previous call's, sent
//     in one pipeline with the call's INSERT;
//   - probe: BEGIN sent with the probe of every key (their records read and
//     their advisory locks taken);
//   - records: every call's record, in one multi-row INSERT sent with
//     COMMIT;
//   - hand: all three, the store's SQL without its Go code.
//
// It reports each one's time and its ratio to the baseline
// ("store/baseline", ...).
func BenchmarkBatchVsBaseline(b *testing.B) {
	schema := pgtest.Schema(b)
	pool := pgtest.Pool(b, schema)
	ctx := context.Background()
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	names := []string{"baseline", "savepoints", "probe", "records", "hand", "store"}
	for _, name := range names {
		if _, err := pool.Exec(ctx, `CREATE TABLE effects_`+name+` (id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
			b.Fatal(err)
		}
	}
	st := newStore(b, pool)
	// As in a consumer, pgx watches the context of every statement.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ops := make([]benchtest.Op, len(names))
	for k, name := range names {
		ops[k] = benchtest.Op{Name: name, Run: func(i int) error {
			if name == "store" {
				return storeBatch(ctx, st, i)
			}
			return handBatch(ctx, pool, name, i)
		}}
	}
	for i := range 3 { // connections, prepared statements
		for _, op := range ops {
			if err := op.Run(-1 - i); err != nil {
				b.Fatal(err)
			}
		}
	}
	ns := benchtest.Interleave(b, ops...)
	for k, name := range names[1:] {
		b.ReportMetric(ns[k+1]/ns[0], name+"/baseline")
	}
}

// batchArrays are the keys, fingerprints, advisory lock ids, outcomes and
// retentions of the batch of iteration i of variant name.
func batchArrays(name string, i int) (keys, fps [][]byte, locks []int64, outcomes [][]byte, retentions []int64) {
	for j := range batchSize {
		k := benchKey(fmt.Sprint(name, i), j)
		keys, fps = append(keys, k[:]), append(fps, fpA[:])
		locks = append(locks, int64(i*batchSize+j))
		outcomes, retentions = append(outcomes, []byte("processed")), append(retentions, retention.Microseconds())
	}
	return keys, fps, locks, outcomes, retentions
}

// handBatch writes a batch by hand: the baseline, with the parts of the
// store's batch that name says.
func handBatch(ctx context.Context, pool *pgxpool.Pool, name string, i int) error {
	savepoints, probe, records := name == "savepoints" || name == "hand", name == "probe" || name == "hand", name == "records" || name == "hand"
	keys, fps, locks, outcomes, retentions := batchArrays(name, i)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	if probe {
		b.Queue(`SELECT CASE WHEN c.key IS NULL THEN pg_try_advisory_xact_lock(i.lock) END, c.fingerprint, c.outcome
FROM unnest($1::bytea[], $2::bytea[], $3::bigint[]) WITH ORDINALITY AS i (key, fingerprint, lock, n)
	LEFT JOIN LATERAL (SELECT k.key, k.fingerprint, k.outcome FROM idempotency_keys AS k WHERE k.key = i.key LIMIT 1) AS c ON true
ORDER BY i.n`, keys, fps, locks)
	}
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return err
	}
	defer conn.Exec(context.WithoutCancel(ctx), "ROLLBACK") // if it failed
	insert := `INSERT INTO effects_` + name + ` (id, amount) VALUES ($1, $2)`
	for j := range batchSize {
		b := &pgx.Batch{}
		if savepoints {
			b.Queue(fmt.Sprint("SAVEPOINT s_", j))
		}
		b.Queue(insert, fmt.Sprint(i, "-", j), j)
		if err := conn.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
	}
	b = &pgx.Batch{}
	if records {
		b.Queue(`INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
SELECT r.key, r.fingerprint, 'completed', 0, now(), now(), now() + r.retention * interval '1 microsecond', r.outcome
FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[]) AS r (key, fingerprint, outcome, retention)`, keys, fps, outcomes, retentions)
	}
	b.Queue("COMMIT")
	return conn.SendBatch(ctx, b).Close()
}

// storeBatch writes a batch through the store.
func storeBatch(ctx context.Context, st *postgres.Store, i int) error {
	rs := make([]store.Reservation, batchSize)
	for j := range rs {
		rs[j] = store.Reservation{Key: benchKey(fmt.Sprint("store", i), j), Fingerprint: fpA, Lease: lease, Retention: retention}
	}
	res, tx, err := st.BeginBatch(ctx, rs)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	for j := range rs {
		if res[j].State != store.Acquired {
			return fmt.Errorf("call %d: %v", j, res[j].State)
		}
		hctx := tx.HandlerContext(ctx, j)
		q, _ := postgres.TxFromContext(hctx)
		if _, err := q.Exec(hctx, `INSERT INTO effects_store (id, amount) VALUES ($1, $2)`, fmt.Sprint(i, "-", j), j); err != nil {
			return err
		}
		if err := tx.Record(ctx, j, []byte("processed"), true); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
}

// BenchmarkTwoPhaseBatch runs a batch of batchSize two-phase calls, each
// writing one row, with their keys reserved together (ReserveBatch, then
// each call's INSERT and Complete) against the same calls one at a time
// (Reserve, INSERT, Complete each) and against the rows written without
// idemkey (an autocommitted INSERT each), interleaved, one batch of each
// per iteration. It reports each one's time and the ratios
// "batch/one-at-a-time" and "batch/baseline".
func BenchmarkTwoPhaseBatch(b *testing.B) {
	schema := pgtest.Schema(b)
	pool := pgtest.Pool(b, schema)
	ctx := context.Background()
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	names := []string{"baseline", "one-at-a-time", "batch"}
	for _, name := range names {
		if _, err := pool.Exec(ctx, `CREATE TABLE "effects_`+name+`" (id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
			b.Fatal(err)
		}
	}
	st := newStore(b, pool)
	ctx, cancel := context.WithCancel(ctx) // as in a consumer
	defer cancel()
	insert := func(name string, i, j int) error {
		_, err := pool.Exec(ctx, `INSERT INTO "effects_`+name+`" (id, amount) VALUES ($1, $2)`, fmt.Sprint(i, "-", j), j)
		return err
	}
	reservations := func(name string, i int) []store.Reservation {
		rs := make([]store.Reservation, batchSize)
		for j := range rs {
			rs[j] = store.Reservation{Key: benchKey(fmt.Sprint(name, i), j), Fingerprint: fpA, Lease: lease, Retention: retention}
		}
		return rs
	}
	run := func(name string, i, j int, token store.Token, key store.Key) error {
		if err := insert(name, i, j); err != nil {
			return err
		}
		return st.Complete(ctx, key, token, []byte("processed"))
	}
	ops := []benchtest.Op{
		{Name: "baseline", Run: func(i int) error {
			for j := range batchSize {
				if err := insert("baseline", i, j); err != nil {
					return err
				}
			}
			return nil
		}},
		{Name: "one-at-a-time", Run: func(i int) error {
			for j, r := range reservations("one-at-a-time", i) {
				res, err := st.Reserve(ctx, r)
				if err != nil {
					return err
				}
				if res.State != store.Acquired {
					return fmt.Errorf("call %d: %v", j, res.State)
				}
				if err := run("one-at-a-time", i, j, res.Token, r.Key); err != nil {
					return err
				}
			}
			return nil
		}},
		{Name: "batch", Run: func(i int) error {
			rs := reservations("batch", i)
			res, err := st.ReserveBatch(ctx, rs)
			if err != nil {
				return err
			}
			for j := range rs {
				if res[j].State != store.Acquired {
					return fmt.Errorf("call %d: %v", j, res[j].State)
				}
				if err := run("batch", i, j, res[j].Token, rs[j].Key); err != nil {
					return err
				}
			}
			return nil
		}},
	}
	for i := range 3 { // connections, prepared statements
		for _, op := range ops {
			if err := op.Run(-1 - i); err != nil {
				b.Fatal(err)
			}
		}
	}
	ns := benchtest.Interleave(b, ops...)
	b.ReportMetric(ns[2]/ns[1], "batch/one-at-a-time")
	b.ReportMetric(ns[2]/ns[0], "batch/baseline")
}
