package postgres_test

import (
	"context"
	"encoding/hex"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/enginetest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// listen runs st.Listen until the test ends, once it listens.
func listen(t testing.TB, st *postgres.Store) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- st.Listen(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Listen ended with %v, want its context's error", err)
		}
	})
	waitUntil(t, "Listen listens", func() bool { return postgres.Listens(st) })
}

// listeningPair is two replicas on one table, a holder and a duplicate's,
// each running Listen.
func listeningPair(t *testing.T) (rs []replica, holder, dup *postgres.Store) {
	t.Helper()
	rs = newReplicas(t, 2)
	listen(t, rs[0].store)
	listen(t, rs[1].store)
	return rs, rs[0].store, rs[1].store
}

// told fails the test unless ch is closed within 30 seconds.
func told(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: the Watch was not told", what)
	}
}

// A duplicate on one replica is told when the call it waits for, on
// another, completes or releases its key; a replica that does not listen
// tells nothing (Watch never fires), and its duplicates poll.
func TestWatchAcrossReplicas(t *testing.T) {
	rs := newReplicas(t, 3)
	holder, dup, deaf := rs[0].store, rs[1].store, rs[2].store
	listen(t, holder)
	listen(t, dup)
	for _, end := range []string{"complete", "release"} {
		key := store.ScopeKey("tenant", "/m", end)
		token := acquire(t, holder, key)
		if res := reserve(t, dup, key, fpA); res.State != store.Held {
			t.Fatalf("duplicate: %v, want held", res.State)
		}
		changed, stop := dup.Watch(key)
		deafChanged, deafStop := deaf.Watch(key)
		if deafChanged != nil {
			t.Fatal("Watch of a store that does not listen: a channel, want nil (the engine polls)")
		}
		select {
		case <-changed:
			t.Fatal("Watch of a key held: told before the holder wrote")
		default:
		}
		var err error
		if end == "complete" {
			err = holder.Complete(context.Background(), key, token, []byte("done"))
		} else {
			err = holder.Release(context.Background(), key, token)
		}
		if err != nil {
			t.Fatalf("%s: %v", end, err)
		}
		told(t, end+" on another replica", changed)
		stop()
		deafStop()
	}
}

// Only a record that a duplicate of the same request waited for costs a
// notification; a listener hears the keys in the order their writes
// committed.
func TestNotifiesOnlyWaitedKeys(t *testing.T) {
	rs := newReplicas(t, 2)
	holder, dup := rs[0].store, rs[1].store
	listen(t, dup)
	ctx := context.Background()
	conn := rawListener(t, rs[0].pool)

	alone, reused, waited := store.ScopeKey("t", "/m", "alone"), store.ScopeKey("t", "/m", "reused"), store.ScopeKey("t", "/m", "waited")
	aloneToken, reusedToken, waitedToken := acquire(t, holder, alone), acquire(t, holder, reused), acquire(t, holder, waited)
	reserve(t, dup, waited, fpA)                  // marks it
	reserve(t, dup, reused, store.Fingerprint{2}) // another request, which the engine answers "reused" and does not wait for
	if err := holder.Complete(ctx, alone, aloneToken, []byte("a")); err != nil {
		t.Fatal(err)
	}
	if err := holder.Complete(ctx, reused, reusedToken, []byte("r")); err != nil {
		t.Fatal(err)
	}
	if err := holder.Complete(ctx, waited, waitedToken, []byte("w")); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n, err := conn.WaitForNotification(wctx)
	if err != nil {
		t.Fatalf("no notification: %v", err)
	}
	if n.Payload != hex.EncodeToString(waited[:]) {
		t.Fatalf("first notification %q, want the waited key's %q: a key no duplicate waited for was notified", n.Payload, hex.EncodeToString(waited[:]))
	}
}

// beginAs begins an atomic call of key on st, failing the test unless
// Begin answers want; it returns the transaction (nil unless acquired).
func beginAs(t *testing.T, st *postgres.Store, key store.Key, want store.State) store.Tx {
	t.Helper()
	res, tx, err := st.Begin(context.Background(), store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
	if err != nil || res.State != want {
		t.Fatalf("Begin = %v, %v; want %v", res.State, err, want)
	}
	return tx
}

// channel is the SQL expression of the test schema's table's channel.
const channel = `'idemkey:' || 'idempotency_keys'::regclass::oid || ':changed'`

// rawListener is a connection of pool's that listens on the channel of
// the test schema's table, as Listen does.
func rawListener(t *testing.T, pool *pgxpool.Pool) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	var name string
	if err := conn.QueryRow(ctx, `SELECT `+channel).Scan(&name); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `LISTEN "`+name+`"`); err != nil {
		t.Fatal(err)
	}
	return conn
}

// Every duplicate told "in progress" hears the end of the call it waits
// for, however its reservation and the holder's Complete interleave: a
// reservation that misses the mark (the record changed under it) runs
// again rather than report a hold it would never hear the end of.
func TestEveryHeldDuplicateIsTold(t *testing.T) {
	_, holder, dup := listeningPair(t)
	ctx := context.Background()
	const rounds, duplicates = 40, 6
	held := 0
	for round := range rounds {
		key := store.ScopeKey("t", "/m", "race-"+string(rune('a'+round%26))+string(rune('a'+round/26)))
		token := acquire(t, holder, key)
		var wg sync.WaitGroup
		start := make(chan struct{})
		results := make(chan store.State, duplicates)
		for i := range duplicates {
			st := []*postgres.Store{holder, dup}[i%2]
			wg.Go(func() {
				<-start
				res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
				if err != nil {
					t.Errorf("Reserve: %v", err)
					return
				}
				results <- res.State
				if res.State != store.Held {
					return
				}
				changed, stop := st.Watch(key)
				defer stop()
				select {
				case <-changed:
				case <-time.After(30 * time.Second):
					t.Errorf("round %d: a duplicate told in progress never heard the Complete", round)
				}
			})
		}
		close(start)
		if err := holder.Complete(ctx, key, token, []byte("done")); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		close(results)
		for s := range results {
			if s == store.Held {
				held++
			}
		}
	}
	if held == 0 {
		t.Fatalf("no duplicate of %d found its key held: the race was not run", rounds*duplicates)
	}
	t.Logf("%d of %d duplicates found the key held", held, rounds*duplicates)
}

// When Listen's connection dies, it connects again, and every key watched
// meanwhile is told changed, since its notification may have been lost.
func TestListenReconnects(t *testing.T) {
	r := newReplica(t)
	listen(t, r.store)
	key := store.ScopeKey("t", "/m", "k")
	token := acquire(t, r.store, key)
	changed, stop := r.store.Watch(key)
	defer stop()
	ctx := context.Background()
	var killed int
	if err := r.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE query = 'LISTEN "' || `+channel+` || '"'`).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminating Listen's connection: %d terminated, %v", killed, err)
	}
	told(t, "a key watched while Listen lost its connection", changed)
	waitUntil(t, "Listen listens again", func() bool { return postgres.Listens(r.store) })

	other := storeOnNewPool(t, r) // not r.store, which tells its own watchers without a notification
	if res := reserve(t, r.store, key, fpA); res.State != store.Held {
		t.Fatalf("Reserve = %v, want held", res.State)
	}
	changed, stop = r.store.Watch(key)
	defer stop()
	if err := other.Complete(ctx, key, token, []byte("done")); err != nil {
		t.Fatal(err)
	}
	told(t, "a Complete after Listen reconnected", changed)
}

// storeOnNewPool is a second store on r's schema, with a pool of its own.
func storeOnNewPool(t *testing.T, r replica) *postgres.Store {
	pool, err := pgxpool.NewWithConfig(context.Background(), r.pool.Config().Copy())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return newStore(t, pool)
}

// One Listen runs at a time; a second returns an error at once.
func TestListenTwice(t *testing.T) {
	r := newReplica(t)
	listen(t, r.store)
	if err := r.store.Listen(context.Background()); err == nil {
		t.Fatal("a second Listen of one store: nil, want an error")
	}
}

// BenchmarkDuplicateAnswered measures how long after a running call's
// record a duplicate held for it has its answer, the two calls on two
// replicas, in two-phase and in atomic mode: told by the store (Listen),
// and polled (enginetest).
func BenchmarkDuplicateAnswered(b *testing.B) {
	rs := newReplicas(b, 2)
	listen(b, rs[0].store)
	listen(b, rs[1].store)
	for _, mode := range []string{"two-phase", "atomic"} {
		b.Run(mode, func(b *testing.B) {
			enginetest.DuplicateAnswered(b, rs[0].store, rs[1].store, mode == "atomic")
		})
	}
}

// BenchmarkListening measures what Listen costs the calls that no duplicate
// waits for: a first call and a replay on a store that listens, against the
// same on a store that does not, on one pool, interleaved.
func BenchmarkListening(b *testing.B) {
	r := newReplica(b)
	listening := newStore(b, r.pool)
	listen(b, listening)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fp := store.Fingerprint{1}
	replayKey := benchKey("replay", 0)
	if err := first(ctx, r.store, replayKey, fp); err != nil {
		b.Fatal(err)
	}
	run := strconv.FormatInt(time.Now().UnixNano(), 36) // new keys on every run
	ns := benchtest.Interleave(b,
		benchtest.Op{Name: "first", Run: func(i int) error { return first(ctx, r.store, benchKey(run+"f", i), fp) }},
		benchtest.Op{Name: "listening-first", Run: func(i int) error { return first(ctx, listening, benchKey(run+"l", i), fp) }},
		benchtest.Op{Name: "replay", Run: func(int) error { return replay(ctx, r.store, replayKey, fp) }},
		benchtest.Op{Name: "listening-replay", Run: func(int) error { return replay(ctx, listening, replayKey, fp) }},
	)
	b.ReportMetric(ns[1]/ns[0], "listening-first/first")
	b.ReportMetric(ns[3]/ns[2], "listening-replay/replay")
}

// In atomic mode, where a running call marks no row, a duplicate on one
// replica asks the holder, on another, to notify its record, and is told
// when it commits; the notification goes to the table's channel only for a
// key a duplicate asked about.
func TestAtomicWatchAcrossReplicas(t *testing.T) {
	rs, holder, dup := listeningPair(t)
	ctx := context.Background()
	conn := rawListener(t, rs[0].pool)

	alone := store.ScopeKey("t", "/m", "alone")
	if err := beginAs(t, holder, alone, store.Acquired).Commit(ctx, []byte("a"), true); err != nil {
		t.Fatal(err)
	}

	key := store.ScopeKey("t", "/m", "asked")
	tx := beginAs(t, holder, key, store.Acquired)
	beginAs(t, dup, key, store.Held)
	changed, stop := dup.Watch(key)
	defer stop()
	waitUntil(t, "the holder hears the duplicate ask", func() bool { return postgres.Wanted(holder, key) })
	select {
	case <-changed:
		t.Fatal("Watch of a key held: told before the holder committed")
	default:
	}
	if err := tx.Commit(ctx, []byte("done"), true); err != nil {
		t.Fatal(err)
	}
	told(t, "an atomic commit on another replica", changed)

	// The raw listener heard the question and the record, and nothing of
	// the key no duplicate asked about.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var heard []string
	for len(heard) < 2 {
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("after %q: %v", heard, err)
		}
		heard = append(heard, n.Payload)
	}
	if want := []string{"ask:" + hex.EncodeToString(key[:]), hex.EncodeToString(key[:])}; heard[0] != want[0] || heard[1] != want[1] {
		t.Fatalf("notifications %q, want %q: only the asked key's question and record", heard, want)
	}
}

// A holder that commits at once, before the duplicate's question reaches
// it (about half the time here), answers the question when it comes: every
// duplicate is told, none left to its next poll.
func TestAtomicCommitBeforeTheQuestionTells(t *testing.T) {
	_, holder, dup := listeningPair(t)
	ctx := context.Background()
	for i := range 20 {
		key := store.ScopeKey("t", "/m", "at-once-"+strconv.Itoa(i))
		tx := beginAs(t, holder, key, store.Acquired)
		beginAs(t, dup, key, store.Held)
		if err := tx.Commit(ctx, []byte("done"), true); err != nil {
			t.Fatal(err)
		}
		changed, stop := dup.Watch(key)
		told(t, "a commit sent as the duplicate asked, round "+strconv.Itoa(i), changed)
		stop()
	}
}

// A duplicate in the holder's own store, whose Begin crosses the holder's
// COMMIT (sent before any question), and finds the key held, is told, as
// one in another store is (TestAtomicCommitBeforeTheQuestionTells). The
// COMMIT is sent at a spread of moments after the duplicate's Begin, so
// that some of them cross.
func TestAtomicOwnDuplicateAsTheHolderCommitsIsTold(t *testing.T) {
	rs := newReplicas(t, 1)
	st := rs[0].store
	listen(t, st)
	ctx := context.Background()
	untold := 0
	for i := range 200 {
		key := store.ScopeKey("t", "/m", "own-"+strconv.Itoa(i))
		tx := beginAs(t, st, key, store.Acquired)
		got := make(chan store.State, 1)
		go func() {
			res, dtx, err := st.Begin(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
			if err != nil {
				t.Error(err)
			}
			if dtx != nil {
				dtx.Rollback(ctx)
			}
			got <- res.State
		}()
		time.Sleep(time.Duration(i%16) * 50 * time.Microsecond)
		if err := tx.Commit(ctx, []byte("done"), true); err != nil {
			t.Fatal(err)
		}
		if <-got != store.Held {
			continue
		}
		changed, stop := st.Watch(key)
		select {
		case <-changed:
		case <-time.After(time.Second):
			untold++
		}
		stop()
	}
	if untold > 0 {
		t.Fatalf("%d of 200 duplicates in the holder's own store, found held as it committed, never told", untold)
	}
}
