package postgres_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// byHand sends the store's own statements for an atomic new key with pgx,
// reading the lock's and the record's answers as Begin does: [BEGIN; lock;
// read; SAVEPOINT] · the handler · [record; COMMIT]. It is the floor of the
// store's Go code (same-sql in BenchmarkDesigns and BenchmarkAtomicGoCost).
type byHand struct {
	pool                        *pgxpool.Pool
	lockSQL, readSQL, recordSQL string
	retention                   time.Duration
}

func newByHand(pool *pgxpool.Pool, st *postgres.Store, retention time.Duration) byHand {
	h := byHand{pool: pool, retention: retention}
	h.lockSQL, h.readSQL, h.recordSQL = postgres.AtomicSQL(st)
	return h
}

// call runs handler for the new key in the transaction, and records
// outcome with COMMIT.
func (h byHand) call(ctx context.Context, key store.Key, fp store.Fingerprint, handler func(postgres.Querier) error) error {
	conn, err := h.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	var (
		locked, found bool
		started       time.Time
	)
	bt := &pgx.Batch{}
	bt.Queue("BEGIN")
	bt.Queue(h.lockSQL, int64(binary.BigEndian.Uint64(key[:8]))).QueryRow(func(row pgx.Row) error { return row.Scan(&locked, &started) })
	bt.Queue(h.readSQL, key[:], fp[:]).QueryRow(func(row pgx.Row) error {
		var (
			completed, takeable bool
			f, o                []byte
			left                pgtype.Interval
			expires             time.Time
		)
		err := row.Scan(&completed, &f, &o, &left, &takeable, &expires)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		return err
	})
	bt.Queue("SAVEPOINT s")
	if err := conn.SendBatch(ctx, bt).Close(); err != nil {
		return err
	}
	if !locked || found {
		return fmt.Errorf("a new key: locked %v, found %v", locked, found)
	}
	if err := handler(conn); err != nil {
		return err
	}
	ct := &pgx.Batch{}
	ct.Queue(h.recordSQL, key[:], fp[:], outcome, h.retention.Microseconds())
	ct.Queue("COMMIT")
	return conn.SendBatch(ctx, ct).Close()
}

// atomicCall runs handler for a new key through st's Begin and Commit.
func atomicCall(ctx context.Context, st *postgres.Store, r store.Reservation, handler func(postgres.Querier) error) error {
	res, tx, err := st.Begin(ctx, r)
	if err != nil || res.State != store.Acquired {
		return fmt.Errorf("begin: %v, %v", res.State, err)
	}
	q, _ := postgres.TxFromContext(tx.HandlerContext(ctx))
	if err := handler(q); err != nil {
		tx.Rollback(ctx)
		return err
	}
	return tx.Commit(ctx, outcome, true)
}

// BenchmarkAtomicGoCost measures what this process spends on an atomic
// new key, the store's Begin, the business INSERT and Commit (store),
// against the same SQL sent by hand (same-sql, byHand), one call at a
// time on one goroutine, so that nothing else runs beside it. -benchmem
// gives allocations per call; go-cpu-ns/op is the process's CPU per call
// (getrusage), which is noisy on a shared machine. The -deadline variants
// give each call a deadline of its own within the store's timeout.
// scripts/atomic-go-cost runs them under valgrind to count their
// instructions per call.
func BenchmarkAtomicGoCost(b *testing.B) {
	schema, _ := chargesSchema(b)
	ctx, cancel := context.WithCancel(context.Background()) // watched by pgx, as a gRPC handler's is
	defer cancel()
	pool := pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.MinConns, c.MaxConns = 2, 2 })
	st := newStore(b, pool, postgres.WithAtomicConns(1))
	fp, lease, retention := store.Fingerprint{1}, time.Minute, 24*time.Hour
	hand := newByHand(pool, st, retention)
	var seq int
	charge := func(variant string) func(postgres.Querier) error {
		return func(q postgres.Querier) error {
			_, err := q.Exec(ctx, `INSERT INTO charges (tenant, id, amount, create_time) VALUES ($1, $2, $3, $4)`,
				"acme", variant+"-"+strconv.Itoa(seq), int64(100), time.Now())
			return err
		}
	}
	handSQL, storeSQL := charge("same-sql"), charge("store")
	hands := func(ctx context.Context) error {
		seq++
		return hand.call(ctx, benchKey("same-sql", seq), fp, handSQL)
	}
	stores := func(ctx context.Context) error {
		seq++
		return atomicCall(ctx, st, store.Reservation{Key: benchKey("store", seq), Fingerprint: fp, Lease: lease, Retention: retention}, storeSQL)
	}
	// withDeadline runs call with a deadline of its own within the store's
	// timeout, as a gRPC call with one has: Begin needs no bound of its own.
	withDeadline := func(call func(context.Context) error) func() error {
		return func() error {
			ctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			return call(ctx)
		}
	}
	variants := []struct {
		name string
		call func() error
	}{
		{"same-sql", func() error { return hands(ctx) }},
		{"store", func() error { return stores(ctx) }},
		{"same-sql-deadline", withDeadline(hands)},
		{"store-deadline", withDeadline(stores)},
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			for range 200 { // warm up: the connections prepare their statements
				if err := v.call(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			cpu := processCPU(b)
			for b.Loop() {
				if err := v.call(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU(b)-cpu)/float64(b.N), "go-cpu-ns/op")
		})
	}
}
