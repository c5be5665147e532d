package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// A pool that sets its search_path in AfterConnect (pgxpool's hook for a
// session's settings) reaches its table through it, and so must Listen's
// connection, which a connection made from the pool's ConnConfig alone
// would not. Here the ConnConfig's search_path names another schema with a
// table of the same name: Listen must still listen on the channel of the
// store's table, and a duplicate of it must be told when the call it waits
// for completes.
func TestListenOnTheStoresTableWhateverTheListenConnsSearchPath(t *testing.T) {
	ctx := context.Background()
	other, mine := pgtest.Schema(t), pgtest.Schema(t)
	for _, schema := range []string{other, mine} {
		if err := postgres.Migrate(ctx, pgtest.Pool(t, schema)); err != nil {
			t.Fatalf("Migrate %s: %v", schema, err)
		}
	}
	pool := pgtest.Pool(t, other, func(c *pgxpool.Config) {
		c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, "SET search_path TO "+mine)
			return err
		}
	})
	dup := newStore(t, pool)
	holder := newStore(t, pgtest.Pool(t, mine))
	listen(t, dup)

	var listening int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE query = 'LISTEN "' || `+channel+` || '"'`).Scan(&listening); err != nil {
		t.Fatal(err)
	}
	if listening != 1 {
		t.Errorf("%d connections listen on the channel of the store's table (%s.idempotency_keys), want 1 (Listen's)", listening, mine)
	}

	key := store.ScopeKey("tenant", "/m", "k")
	token := acquire(t, holder, key)
	if res := reserve(t, dup, key, fpA); res.State != store.Held {
		t.Fatalf("duplicate: %v, want held", res.State)
	}
	changed, stop := dup.Watch(key)
	defer stop()
	if err := holder.Complete(ctx, key, token, []byte("done")); err != nil {
		t.Fatal(err)
	}
	told(t, "a Complete of the store's table", changed)
}

// A duplicate told "in progress" by a store that listens has marked the
// record waited, so that its Complete notifies (the promise of insertSQL's
// doc: "a duplicate is never told in progress of a record whose
// notification it would not hear"). Here insertSQL finds the record's
// lease ended and takeable, and by the time reserveSQL runs, another
// replica has taken it over: reserveSQL answers "in progress" from a
// record it did not mark.
func TestHeldAfterALostTakeoverIsMarked(t *testing.T) {
	rs := newReplicas(t, 2)
	holder, dup := rs[0].store, rs[1].store
	listen(t, dup)
	ctx := context.Background()
	key := store.ScopeKey("tenant", "/m", "k")
	acquire(t, holder, key)
	rs[0].advance(t, lease+time.Second) // takeable by fpA

	// Another replica's takeover (reserveSQL's ON CONFLICT DO UPDATE), in
	// flight: it has written the row and not committed yet.
	tx, err := rs[0].pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var token int64
	var pid int32
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `UPDATE idempotency_keys SET token = nextval('idempotency_keys_token_seq'),
		lease_end = now() + $2 * interval '1 microsecond', outcome = NULL, waited = false
		WHERE key = $1 RETURNING token`, key[:], lease.Microseconds()).Scan(&token); err != nil {
		t.Fatal(err)
	}

	type result struct {
		res store.Entry
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := dup.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
		done <- result{res, err}
	}()
	// The duplicate's insert waits for the takeover's row, its snapshot
	// taken before the takeover commits.
	waitUntil(t, "the duplicate's reservation waits for the takeover", func() bool {
		var n int
		err := rs[0].pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return err == nil && n > 0
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if got.err != nil {
		t.Fatalf("duplicate's Reserve: %v", got.err)
	}
	if got.res.State != store.Held {
		t.Fatalf("duplicate's Reserve = %v, want held (the takeover's run)", got.res.State)
	}
	if n := rs[0].count(t, "waited"); n != 1 {
		t.Errorf("the duplicate was told in progress, yet %d records are marked waited, want 1: the new run's Complete will not notify", n)
	}
	changed, stop := dup.Watch(key)
	defer stop()
	if err := holder.Complete(ctx, key, store.Token(token), []byte("done")); err != nil {
		t.Fatal(err)
	}
	told(t, "the Complete of the run that took the record over", changed)
}

// In atomic mode, a duplicate that Begin answers by the probe on its own
// (every transaction slot of its store taken, no connection to lend) asks
// the holder nothing, and must not count as having asked: the next
// duplicate of the run on the same store, answered in a transaction,
// asks the holder to notify its record, and is told when it commits.
func TestAtomicAskAfterAProbedDuplicate(t *testing.T) {
	rs := newReplicas(t, 2)
	holder := rs[0].store
	ctx := context.Background()
	// dup's only slot, and one of its two connections, go to a call of
	// another key; the other connection is the last free, which dup lends
	// to no call (claim), so its next Begin runs the probe on its own.
	dup := newStore(t, openPool(t, schemaOf(t, rs[1].pool), func(c *pgxpool.Config) { c.MaxConns = 2 }), postgres.WithAtomicConns(1))
	listen(t, holder)
	listen(t, dup)
	key, other := store.ScopeKey("t", "/m", "k"), store.ScopeKey("t", "/m", "other")
	tx := beginAs(t, holder, key, store.Acquired)
	defer tx.Rollback(ctx)
	otherTx := beginAs(t, dup, other, store.Acquired)
	beginAs(t, dup, key, store.Held) // probed: dup's only slot is taken
	if n := postgres.Probed(dup); n != 1 {
		t.Fatalf("dup ran the probe on its own %d times, want 1", n)
	}
	if err := otherTx.Commit(ctx, []byte("o"), true); err != nil {
		t.Fatal(err)
	}
	beginAs(t, dup, key, store.Held)
	if n := postgres.Probed(dup); n != 1 {
		t.Fatalf("dup ran the probe on its own %d times, want 1: the second duplicate was to run in a transaction", n)
	}
	changed, stop := dup.Watch(key)
	defer stop()
	waitUntil(t, "the holder hears the second duplicate ask", func() bool { return postgres.Wanted(holder, key) })
	if err := tx.Commit(ctx, []byte("done"), true); err != nil {
		t.Fatal(err)
	}
	told(t, "the holder's commit", changed)
}

// In atomic mode, a duplicate that asked the holder to notify its record
// is told when the holder rolls back as well as when it commits (the key
// is free: its next Begin acquires it), and a later run of the key is
// asked about afresh by the same store: a question left unanswered by a
// rollback does not keep the store from asking the next holder.
func TestAtomicAskedHolderRollsBack(t *testing.T) {
	rs := newReplicas(t, 3)
	holder, next, dup := rs[0].store, rs[1].store, rs[2].store
	listen(t, holder)
	listen(t, next)
	listen(t, dup)
	ctx := context.Background()
	key := store.ScopeKey("t", "/m", "k")
	begin := func(st *postgres.Store, want store.State) store.Tx { return beginAs(t, st, key, want) }
	tx := begin(holder, store.Acquired)
	begin(dup, store.Held)
	changed, stop := dup.Watch(key)
	defer stop()
	waitUntil(t, "the holder hears the duplicate ask", func() bool { return postgres.Wanted(holder, key) })
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	told(t, "the asked holder's rollback", changed)

	tx = begin(next, store.Acquired)
	defer tx.Rollback(ctx)
	begin(dup, store.Held)
	waitUntil(t, "the next holder hears the duplicate ask", func() bool { return postgres.Wanted(next, key) })
}
