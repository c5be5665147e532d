package postgres_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// Shape of BenchmarkDesigns: as the outside benchmark of issue 25, 16
// workers on a pool of 20, designsCalls calls per variant per round.
const (
	designsWorkers = 16
	designsPool    = 20
	designsCalls   = 1600
	designsRecords = 10000 // recorded keys that select and find read
)

// BenchmarkDesigns measures what the database work of a call costs under
// concurrency, the store against hand-written SQL of each design, on one
// pool, variants interleaved in rounds (each variant runs alone in its turn,
// so that its WAL can be told apart):
//   - bare: the business write alone, an autocommitted INSERT;
//   - minimal-atomic: the two-write design in one transaction, in the
//     store's round trips: [BEGIN; reservation INSERT] · INSERT ·
//     [UPDATE by key; COMMIT];
//   - one-write: the design of the store, by hand: [BEGIN; read the key and,
//     with no record, try its advisory lock; SAVEPOINT] · INSERT · [INSERT
//     of the completed record; COMMIT];
//   - same-sql: the store's own statements for a new key, sent by hand with
//     pgx, reading the lock's and the record's answers as Begin does:
//     [BEGIN; lock; read; SAVEPOINT] · INSERT · [record; COMMIT], the floor
//     of the store's Go code;
//   - atomic: the store's Begin, the INSERT in its transaction, and Commit;
//   - minimal-two-phase and two-phase: reserve, the INSERT, record, each
//     committing on its own, by hand and through the store;
//   - select and find: a recorded key read by primary key, by hand and with
//     the store's Find; select-expiry reads the record's expiry too, as
//     Find does so that a replay tells it.
//
// For each it reports calls per second, PostgreSQL's CPU per call (the
// pool's backends, from /proc, so the database must run on this machine),
// this Go process's CPU per call (pgx's side of the SQL: what a server
// spends on it besides its own work) and WAL bytes per call, and the
// ratios the targets of issue 25 name.
func BenchmarkDesigns(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background()) // watched by pgx, as a gRPC handler's is
	defer cancel()
	schema, setup := chargesSchema(b, postgres.DefaultTable, "baseline_keys")
	pool := pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.MinConns, c.MaxConns = designsPool, designsPool })
	pids := backendPids(b, pool)
	st := newStore(b, pool, postgres.WithAtomicConns(designsWorkers))

	fp := store.Fingerprint{1}
	lease, retention := time.Minute, 24*time.Hour
	hand := newByHand(pool, st, retention)
	for i := range designsRecords { // the recorded keys, in both tables
		r := store.Reservation{Key: benchKey("recorded", i), Fingerprint: fp, Lease: lease, Retention: retention}
		res, err := st.Reserve(ctx, r)
		if err == nil {
			err = st.Complete(ctx, r.Key, res.Token, outcome)
		}
		if err == nil {
			_, err = setup.Exec(ctx, `INSERT INTO baseline_keys (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
				VALUES ($1, $2, 'completed', 0, now(), now(), now() + interval '1 day', $3)`, r.Key[:], fp[:], outcome)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	if _, err := setup.Exec(ctx, `VACUUM ANALYZE`); err != nil {
		b.Fatal(err)
	}

	charge := func(q postgres.Querier, variant string, i int64) error {
		_, err := q.Exec(ctx, `INSERT INTO charges (tenant, id, amount, create_time) VALUES ($1, $2, $3, $4)`,
			"acme", variant+"-"+strconv.FormatInt(i, 10), int64(100), time.Now())
		return err
	}
	var seq atomic.Int64 // a new key for every call of every variant
	newKey := func(variant string) (store.Key, int64) {
		i := seq.Add(1)
		return benchKey(variant, int(i)), i
	}
	recorded := func() store.Key { return benchKey("recorded", rand.IntN(designsRecords)) }
	inTx := func(variant string, begin func(*pgx.Batch, store.Key), record string) func() error {
		return func() error {
			key, i := newKey(variant)
			conn, err := pool.Acquire(ctx)
			if err != nil {
				return err
			}
			defer conn.Release()
			bt := &pgx.Batch{}
			bt.Queue("BEGIN")
			begin(bt, key)
			if err := conn.SendBatch(ctx, bt).Close(); err != nil {
				return err
			}
			if err := charge(conn, variant, i); err != nil {
				return err
			}
			ct := &pgx.Batch{}
			ct.Queue(record, key[:], fp[:], outcome)
			ct.Queue("COMMIT")
			return conn.SendBatch(ctx, ct).Close()
		}
	}
	variants := []struct {
		name string
		call func() error
	}{
		{"bare", func() error { _, i := newKey("bare"); return charge(pool, "bare", i) }},
		{"minimal-atomic", inTx("minimal-atomic", func(bt *pgx.Batch, key store.Key) {
			bt.Queue(minimalReserveKeyed, key[:], fp[:])
		}, `UPDATE baseline_keys SET state = 'completed', outcome = $3 WHERE key = $1 AND fingerprint = $2`)},
		{"one-write", inTx("one-write", func(bt *pgx.Batch, key store.Key) {
			bt.Queue(oneWriteProbe, key[:], int64(binary.BigEndian.Uint64(key[:8])))
			bt.Queue("SAVEPOINT s")
		}, `INSERT INTO baseline_keys (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
			VALUES ($1, $2, 'completed', 0, now(), now(), now() + interval '1 day', $3)`)},
		{"same-sql", func() error {
			key, i := newKey("same-sql")
			return hand.call(ctx, key, fp, func(q postgres.Querier) error { return charge(q, "same-sql", i) })
		}},
		{"atomic", func() error {
			key, i := newKey("atomic")
			r := store.Reservation{Key: key, Fingerprint: fp, Lease: lease, Retention: retention}
			return atomicCall(ctx, st, r, func(q postgres.Querier) error { return charge(q, "atomic", i) })
		}},
		{"minimal-two-phase", func() error {
			key, i := newKey("minimal-two-phase")
			if _, err := pool.Exec(ctx, minimalReserveKeyed, key[:], fp[:]); err != nil {
				return err
			}
			if err := charge(pool, "minimal-two-phase", i); err != nil {
				return err
			}
			_, err := pool.Exec(ctx, `UPDATE baseline_keys SET state = 'completed', outcome = $3 WHERE key = $1 AND fingerprint = $2`, key[:], fp[:], outcome)
			return err
		}},
		{"two-phase", func() error {
			key, i := newKey("two-phase")
			r := store.Reservation{Key: key, Fingerprint: fp, Lease: lease, Retention: retention}
			res, err := st.Reserve(ctx, r)
			if err != nil || res.State != store.Acquired {
				return fmt.Errorf("reserve: %v, %v", res.State, err)
			}
			if err := charge(pool, "two-phase", i); err != nil {
				return err
			}
			return st.Complete(ctx, key, res.Token, outcome)
		}},
		{"select", func() error {
			key := recorded()
			var f, o []byte
			return pool.QueryRow(ctx, `SELECT fingerprint, outcome FROM baseline_keys WHERE key = $1`, key[:]).Scan(&f, &o)
		}},
		{"select-expiry", func() error { // what a replay reads now: the key's expiry too
			key := recorded()
			var f, o []byte
			var e time.Time
			return pool.QueryRow(ctx, `SELECT fingerprint, outcome, expires_at FROM baseline_keys WHERE key = $1`, key[:]).Scan(&f, &o, &e)
		}},
		{"find", func() error {
			_, ok, err := st.Find(ctx, recorded())
			if err == nil && !ok {
				err = fmt.Errorf("find: a recorded key was not found")
			}
			return err
		}},
	}

	// run runs calls of call on designsWorkers goroutines, and returns how
	// long they took, PostgreSQL's CPU time, this process's CPU time and WAL
	// bytes meanwhile.
	run := func(call func() error, calls int) (took, cpu, self time.Duration, wal int64) {
		var lsn string
		if err := setup.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
			b.Fatal(err)
		}
		before, selfBefore := backendsCPU(b, pids), processCPU(b)
		start := time.Now()
		var (
			wg   sync.WaitGroup
			left atomic.Int64
			fail atomic.Value
		)
		left.Store(int64(calls))
		for range designsWorkers {
			wg.Go(func() {
				for left.Add(-1) >= 0 {
					if err := call(); err != nil {
						fail.CompareAndSwap(nil, err)
						return
					}
				}
			})
		}
		wg.Wait()
		took = time.Since(start)
		cpu, self = backendsCPU(b, pids)-before, processCPU(b)-selfBefore
		if err, _ := fail.Load().(error); err != nil {
			b.Fatal(err)
		}
		if err := setup.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint`, lsn).Scan(&wal); err != nil {
			b.Fatal(err)
		}
		return took, cpu, self, wal
	}
	for _, v := range variants { // warm up: connections prepare their statements
		run(v.call, 4*designsPool)
	}
	took := make([]time.Duration, len(variants))
	cpu := make([]time.Duration, len(variants))
	self := make([]time.Duration, len(variants))
	wal := make([]int64, len(variants))
	rounds := 0
	for b.Loop() {
		for j := range variants {
			k := (rounds + j) % len(variants)
			t, c, g, w := run(variants[k].call, designsCalls)
			took[k] += t
			cpu[k] += c
			self[k] += g
			wal[k] += w
		}
		rounds++
	}
	calls := float64(rounds * designsCalls)
	rate := make(map[string]float64, len(variants))
	perCPU := make(map[string]float64, len(variants))
	perWAL := make(map[string]float64, len(variants))
	perGo := make(map[string]float64, len(variants))
	for k, v := range variants {
		rate[v.name] = calls / took[k].Seconds()
		perCPU[v.name] = float64(cpu[k].Nanoseconds()) / calls
		perWAL[v.name] = float64(wal[k]) / calls
		perGo[v.name] = float64(self[k].Nanoseconds()) / calls
		b.ReportMetric(rate[v.name], v.name+"-calls/s")
		b.ReportMetric(perCPU[v.name], v.name+"-cpu-ns/call")
		b.ReportMetric(perGo[v.name], v.name+"-go-cpu-ns/call")
		if v.name != "select" && v.name != "select-expiry" && v.name != "find" {
			b.ReportMetric(perWAL[v.name], v.name+"-wal-B/call")
		}
	}
	for _, pair := range [][2]string{{"atomic", "minimal-atomic"}, {"atomic", "one-write"}, {"atomic", "same-sql"}, {"two-phase", "minimal-two-phase"}, {"find", "select"}, {"find", "select-expiry"}, {"atomic", "bare"}} {
		a, base := pair[0], pair[1]
		b.ReportMetric(rate[a]/rate[base], a+"/"+base+"-throughput")
		b.ReportMetric(perCPU[a]/perCPU[base], a+"/"+base+"-cpu")
		if a != "find" {
			b.ReportMetric(perWAL[a]/perWAL[base], a+"/"+base+"-wal")
		}
	}
	// What the Go side of a new key costs against the bare INSERT: the
	// design itself (one-write, by hand), and the store; the store's against
	// its own SQL by hand (same-sql), which is its code's cost alone; and
	// that SQL's against one-write's, the cost of the store's statements.
	for _, pair := range [][2]string{{"one-write", "bare"}, {"atomic", "bare"}, {"atomic", "one-write"}, {"atomic", "same-sql"}, {"same-sql", "one-write"}} {
		b.ReportMetric(perGo[pair[0]]/perGo[pair[1]], pair[0]+"/"+pair[1]+"-go-cpu")
	}
}

// processCPU is the CPU time this process has spent, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Hand-written statements of BenchmarkDesigns.
const (
	// minimalReserveKeyed is the two-write design's reservation.
	minimalReserveKeyed = `INSERT INTO baseline_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
		VALUES ($1, $2, 'in_progress', nextval('baseline_keys_token_seq'), now() + interval '1 minute', now(), now() + interval '1 day')
		ON CONFLICT DO NOTHING`
	// oneWriteProbe reads the key and, with no record, tries its lock.
	oneWriteProbe = `SELECT CASE WHEN c.key IS NULL THEN pg_try_advisory_xact_lock($2) END, c.outcome
		FROM (VALUES (1)) AS one (x) LEFT JOIN baseline_keys AS c ON c.key = $1`
)

// acquireAll acquires every connection of pool, which must hold MinConns =
// MaxConns connections: once they are released, the pool has opened them
// all, and none is still being made.
func acquireAll(b *testing.B, pool *pgxpool.Pool) []*pgxpool.Conn {
	b.Helper()
	conns := make([]*pgxpool.Conn, pool.Config().MaxConns)
	for i := range conns {
		var err error
		if conns[i], err = pool.Acquire(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	return conns
}

// backendPids returns the backend process ids of every connection of pool,
// which must hold MinConns = MaxConns connections.
func backendPids(b *testing.B, pool *pgxpool.Pool) []int {
	b.Helper()
	conns := acquireAll(b, pool)
	pids := make([]int, len(conns))
	for i, c := range conns {
		if err := c.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pids[i]); err != nil {
			b.Fatal(err)
		}
	}
	for _, c := range conns {
		c.Release()
	}
	if _, err := pgtest.BackendCPU(pids[0]); err != nil {
		b.Skipf("the backend's CPU cannot be read here (is PostgreSQL on another machine?): %v", err)
	}
	return pids
}

// backendsCPU is the CPU time the backends of pids have spent.
func backendsCPU(b *testing.B, pids []int) time.Duration {
	var sum time.Duration
	for _, pid := range pids {
		d, err := pgtest.BackendCPU(pid)
		if err != nil {
			b.Fatalf("backend %d: %v", pid, err)
		}
		sum += d
	}
	return sum
}

// BenchmarkAtomicNewKeys runs b.N atomic calls with new keys (the store's
// Begin, the business INSERT, Commit) on 16 workers and a pool of 20, with
// the default slots (15), and reports how many Begin answered anything but
// Acquired: a new key must never be told that another call holds it, even
// while PostgreSQL makes the workers wait to extend the tables' files. It
// reports too how many calls ran the probe on their own: none may, since a
// call that finds every slot taken waits for one in its transaction on one
// of the connections the slots leave free. make bench runs it with
// -benchtime=100000x.
func BenchmarkAtomicNewKeys(b *testing.B) {
	schema, _ := chargesSchema(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.MinConns, c.MaxConns = designsPool, designsPool })
	st := newStore(b, pool)
	for _, c := range acquireAll(b, pool) {
		c.Release()
	}
	var (
		next                atomic.Int64
		notAcquired, failed atomic.Int64
		wg                  sync.WaitGroup
	)
	b.ResetTimer()
	for range designsWorkers {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(b.N); i = next.Add(1) {
				res, tx, err := st.Begin(ctx, store.Reservation{Key: benchKey("new", int(i)), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: 24 * time.Hour})
				switch {
				case err != nil:
					failed.Add(1)
					continue
				case res.State != store.Acquired:
					notAcquired.Add(1)
					continue
				}
				q, _ := postgres.TxFromContext(tx.HandlerContext(ctx))
				if _, err := q.Exec(ctx, `INSERT INTO charges (tenant, id, amount, create_time) VALUES ('acme', $1, 100, now())`, strconv.FormatInt(i, 10)); err != nil {
					tx.Rollback(ctx)
					failed.Add(1)
					continue
				}
				if err := tx.Commit(ctx, outcome, true); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	b.ReportMetric(float64(notAcquired.Load()), "not-acquired")
	b.ReportMetric(float64(failed.Load()), "failed")
	b.ReportMetric(float64(postgres.Probed(st)), "probed")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
	if n := notAcquired.Load() + failed.Load() + postgres.Probed(st); n > 0 {
		b.Errorf("%d of %d new keys were not acquired, %d failed and %d ran the probe on their own", notAcquired.Load(), b.N, failed.Load(), postgres.Probed(st))
	}
}

// chargesSchema is a schema of its own with the store's tables (the
// default table, or those named) and the example's charges, and a pool on
// it to set it up with.
func chargesSchema(b *testing.B, tables ...string) (schema string, setup *pgxpool.Pool) {
	b.Helper()
	schema = pgtest.Schema(b)
	ctx := context.Background()
	setup = pgtest.Pool(b, schema)
	if len(tables) == 0 {
		tables = []string{postgres.DefaultTable}
	}
	for _, table := range tables {
		if err := postgres.Migrate(ctx, setup, postgres.WithTable(table)); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := setup.Exec(ctx, `CREATE TABLE charges (tenant text NOT NULL, id text NOT NULL, amount bigint NOT NULL,
		create_time timestamptz NOT NULL, PRIMARY KEY (tenant, id))`); err != nil {
		b.Fatal(err)
	}
	return schema, setup
}
