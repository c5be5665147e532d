package postgres

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
)

// BenchmarkStatements breaks the backend CPU of an atomic new key down by the
// store's statements: each variant is the one-write design's minimal SQL in
// one transaction (BEGIN and an advisory lock, a business INSERT, a plain
// INSERT of the record and COMMIT, in the store's round trips) with one of
// the store's statements in place or added (the savepoint, the read of the
// record, the lock on the key XOR the table's OID), and "store" has them
// all. Each
// runs on a backend of its own, interleaved, and reports the backend CPU it
// spends beyond the minimal SQL, read from /proc/PID/schedstat (so the
// database must run on this machine).
func BenchmarkStatements(b *testing.B) {
	schema := pgtest.Schema(b)
	ctx := context.Background()
	if err := Migrate(ctx, pgtest.Pool(b, schema)); err != nil {
		b.Fatal(err)
	}
	setup := pgtest.Pool(b, schema)
	if _, err := setup.Exec(ctx, `CREATE TABLE charges (tenant text NOT NULL, id text NOT NULL, amount bigint NOT NULL,
		create_time timestamptz NOT NULL, PRIMARY KEY (tenant, id))`); err != nil {
		b.Fatal(err)
	}
	st, err := New(setup)
	if err != nil {
		b.Fatal(err)
	}
	const (
		// The lock, and when the transaction that holds it started, as the
		// store's lockSQL tells it.
		plainLock   = `SELECT pg_try_advisory_xact_lock($1), now()`
		plainRecord = `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
		VALUES ($1, $2, 'completed', 0, now(), now(), now() + $4 * interval '1 microsecond', $3)`
	)
	variants := []struct {
		name               string
		savepoint, read    bool
		lockSQL, recordSQL string
	}{
		{"minimal", false, false, plainLock, plainRecord},
		{"savepoint", true, false, plainLock, plainRecord}, // the savepoint before the handler
		{"read", false, true, plainLock, plainRecord},      // the record read once the lock is tried
		{"lock", false, false, st.lockSQL, plainRecord},    // the lock of the store, XOR the table's OID
		{"store", true, true, st.lockSQL, st.recordSQL},
	}
	pools := make([]*pgxpool.Pool, len(variants))
	pids := make([]int, len(variants))
	for k := range variants {
		pools[k] = pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.MinConns, c.MaxConns = 1, 1 })
		if err := pools[k].QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pids[k]); err != nil {
			b.Fatal(err)
		}
		if _, err := pgtest.BackendCPU(pids[k]); err != nil {
			b.Skipf("the backend's CPU cannot be read here (is PostgreSQL on another machine?): %v", err)
		}
	}
	fp := make([]byte, 32)
	outcome := make([]byte, 120)
	run := func(k, i int) error {
		v := variants[k]
		conn, err := pools[k].Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		id := v.name + "-" + strconv.Itoa(i)
		key := sha256.Sum256([]byte(id))
		var (
			locked  bool
			started time.Time
		)
		begin := &pgx.Batch{}
		begin.Queue("BEGIN")
		begin.Queue(v.lockSQL, lockID(key)).QueryRow(func(row pgx.Row) error { return row.Scan(&locked, &started) })
		if v.read {
			begin.Queue(st.readSQL, key[:], fp).QueryRow(func(row pgx.Row) error {
				_, err := (&keyRecord{}).scan(row)
				return err
			})
		}
		if v.savepoint {
			begin.Queue("SAVEPOINT " + savepoint)
		}
		if err := conn.SendBatch(ctx, begin).Close(); err != nil {
			return err
		}
		if !locked {
			return fmt.Errorf("the key's lock was not taken")
		}
		if _, err := conn.Exec(ctx, `INSERT INTO charges (tenant, id, amount, create_time) VALUES ($1, $2, $3, $4)`,
			"acme", id, int64(100), time.Now()); err != nil {
			return err
		}
		commit := &pgx.Batch{}
		commit.Queue(v.recordSQL, key[:], fp, outcome, int64(86400e6))
		commit.Queue("COMMIT")
		return conn.SendBatch(ctx, commit).Close()
	}
	for k := range variants { // prepare the statements
		if err := run(k, -1); err != nil {
			b.Fatalf("%s: %v", variants[k].name, err)
		}
	}
	spent := make([]time.Duration, len(variants))
	n := 0
	for b.Loop() {
		for j := range variants {
			k := (n + j) % len(variants)
			before, _ := pgtest.BackendCPU(pids[k])
			if err := run(k, n); err != nil {
				b.Fatalf("%s: %v", variants[k].name, err)
			}
			after, _ := pgtest.BackendCPU(pids[k])
			spent[k] += after - before
		}
		n++
	}
	minimal := float64(spent[0].Nanoseconds()) / float64(n)
	b.ReportMetric(minimal, "minimal-cpu-ns/op")
	for k, v := range variants[1:] {
		b.ReportMetric(float64(spent[k+1].Nanoseconds())/float64(n)-minimal, v.name+"-extra-cpu-ns/op")
	}
	b.ReportMetric(float64(spent[len(spent)-1].Nanoseconds())/float64(n)/minimal, "store/minimal")
}
