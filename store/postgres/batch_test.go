package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// batchReplica is a replica with a table effects for the writes of a
// batch's calls.
func batchReplica(t *testing.T, configure ...func(*pgxpool.Config)) replica {
	t.Helper()
	r := newReplica(t, configure...)
	if _, err := r.pool.Exec(context.Background(), `CREATE TABLE effects (n bigserial PRIMARY KEY, id text NOT NULL UNIQUE)`); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r replica) effectIDs(t *testing.T) []string {
	t.Helper()
	rows, _ := r.pool.Query(context.Background(), `SELECT id FROM effects ORDER BY n`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func batchKey(name string) store.Key { return store.ScopeKey("", "batch", name) }

func reservations(names ...string) []store.Reservation {
	rs := make([]store.Reservation, len(names))
	for i, name := range names {
		rs[i] = store.Reservation{Key: batchKey(name), Fingerprint: fpA, Lease: lease, Retention: retention}
	}
	return rs
}

func querier(t *testing.T, ctx context.Context) postgres.Querier {
	t.Helper()
	q, ok := postgres.TxFromContext(ctx)
	if !ok {
		t.Fatal("no transaction in the handler's context")
	}
	return q
}

// BeginBatch decides each key as Begin decides one: free, recorded, held
// by a two-phase reservation, held by a running atomic call, or taken over.
func TestBatchDecisions(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	// recorded: an atomic call committed it.
	res, tx, err := r.store.Begin(ctx, reservations("recorded")[0])
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin: %+v, %v", res, err)
	}
	if err := tx.Commit(ctx, []byte("recorded outcome"), true); err != nil {
		t.Fatal(err)
	}
	// busy: an atomic call that runs.
	_, running, err := r.store.Begin(ctx, reservations("busy")[0])
	if err != nil || running == nil {
		t.Fatalf("Begin: %v", err)
	}
	defer running.Rollback(ctx)
	// expired: a record whose retention has passed.
	expired := reservations("expired")[0]
	expired.Retention = time.Second
	res, tx, err = r.store.Begin(ctx, expired)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin: %+v, %v", res, err)
	}
	if err := tx.Commit(ctx, []byte("old"), true); err != nil {
		t.Fatal(err)
	}
	r.advance(t, time.Minute)
	// held: a two-phase reservation under a live lease.
	if res, err := r.store.Reserve(ctx, reservations("held")[0]); err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}

	rs := reservations("free", "recorded", "held", "busy", "expired")
	results, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	states := make([]store.State, len(results))
	for i, res := range results {
		states[i] = res.State
	}
	if want := []store.State{store.Acquired, store.Completed, store.Held, store.Held, store.Acquired}; !slices.Equal(states, want) {
		t.Fatalf("states %v, want %v", states, want)
	}
	if string(results[1].Outcome) != "recorded outcome" || results[1].Fingerprint != fpA {
		t.Fatalf("recorded: %+v", results[1])
	}
	if results[2].RetryAfter <= 0 || results[2].RetryAfter > lease || results[3].Fingerprint != fpA || results[3].RetryAfter != lease {
		t.Fatalf("in progress: %+v and %+v", results[2], results[3])
	}
	for _, i := range []int{0, 4} {
		hctx := btx.HandlerContext(ctx, i)
		if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
		if err := btx.Record(ctx, i, []byte("outcome "+fmt.Sprint(i)), true); err != nil {
			t.Fatal(err)
		}
	}
	if err := btx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, i := range []int{0, 4} {
		res, ok, err := r.store.Find(ctx, rs[i].Key)
		if err != nil || !ok || string(res.Outcome) != "outcome "+fmt.Sprint(i) {
			t.Fatalf("Find %d: %+v, %v, %v", i, res, ok, err)
		}
	}
	if got := r.effectIDs(t); !slices.Equal(got, []string{"0", "4"}) {
		t.Fatalf("effects %v", got)
	}
	// Nothing acquired: no transaction is left open.
	results, btx, err = r.store.BeginBatch(ctx, reservations("free", "recorded"))
	if err != nil || btx != nil || results[0].State != store.Completed || results[1].State != store.Completed {
		t.Fatalf("all recorded: %+v, %v, %v", results, btx, err)
	}
	if _, _, err := r.store.BeginBatch(ctx, reservations("a", "b", "a")); err == nil {
		t.Fatal("a batch with a key twice was accepted")
	}
}

// Each call's writes are its own, whichever of the Querier's methods wrote
// them: a call that is released or records an error has its writes undone,
// alone, even after a statement of its failed; the others' commit.
func TestBatchCallsApart(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	insert := `INSERT INTO effects (id) VALUES ($1)`
	type call struct {
		name       string
		write      func(q postgres.Querier, ctx context.Context, id string) error
		fail       bool // run a statement that fails after the write
		end        string
		wantRecord bool
	}
	calls := []call{
		{name: "exec", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.Exec(ctx, insert, id)
			return err
		}, end: "keep", wantRecord: true},
		{name: "exec-no-args", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.Exec(ctx, `INSERT INTO effects (id) VALUES ('`+id+`'); INSERT INTO effects (id) VALUES ('`+id+`-2')`)
			return err
		}, end: "keep", wantRecord: true},
		{name: "query-row", write: func(q postgres.Querier, ctx context.Context, id string) error {
			var n int64
			return q.QueryRow(ctx, insert+` RETURNING n`, id).Scan(&n)
		}, end: "undo", wantRecord: true},
		{name: "query", write: func(q postgres.Querier, ctx context.Context, id string) error {
			rows, _ := q.Query(ctx, insert+` RETURNING n`, id)
			_, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			return err
		}, end: "keep", wantRecord: true},
		{name: "send-batch", write: func(q postgres.Querier, ctx context.Context, id string) error {
			b := &pgx.Batch{}
			b.Queue(insert, id)
			b.Queue(insert, id+"-2")
			return q.SendBatch(ctx, b).Close()
		}, end: "release"},
		{name: "copy-from", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.CopyFrom(ctx, pgx.Identifier{"effects"}, []string{"id"}, pgx.CopyFromRows([][]any{{id}}))
			return err
		}, end: "keep", wantRecord: true},
		{name: "failed-recorded", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.Exec(ctx, insert, id)
			return err
		}, fail: true, end: "undo", wantRecord: true},
		{name: "failed-ok", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.Exec(ctx, insert, id)
			return err
		}, fail: true, end: "keep"},
		{name: "nothing", write: func(postgres.Querier, context.Context, string) error { return nil }, end: "keep", wantRecord: true},
		{name: "last", write: func(q postgres.Querier, ctx context.Context, id string) error {
			_, err := q.Exec(ctx, insert, id)
			return err
		}, end: "keep", wantRecord: true},
	}
	names := make([]string, len(calls))
	for i, c := range calls {
		names[i] = c.name
	}
	rs := reservations(names...)
	_, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	for i, c := range calls {
		hctx := btx.HandlerContext(ctx, i)
		q := querier(t, hctx)
		if err := c.write(q, hctx, c.name); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if c.fail {
			if _, err := q.Exec(hctx, insert, c.name); err == nil { // a unique violation
				t.Fatalf("%s: the failing statement succeeded", c.name)
			}
		}
		switch c.end {
		case "keep":
			err := btx.Record(ctx, i, []byte(c.name), true)
			if c.fail != (err != nil) {
				t.Fatalf("%s: Record: %v", c.name, err)
			}
		case "undo":
			if err := btx.Record(ctx, i, []byte(c.name), false); err != nil {
				t.Fatalf("%s: Record: %v", c.name, err)
			}
		case "release":
			if err := btx.Release(ctx, i); err != nil {
				t.Fatalf("%s: Release: %v", c.name, err)
			}
		}
		if _, err := q.Exec(hctx, insert, c.name+"-late"); err == nil {
			t.Fatalf("%s: the handler's Querier still wrote after its call ended", c.name)
		}
		if btx.Err() != nil {
			t.Fatalf("%s: the batch failed: %v", c.name, btx.Err())
		}
	}
	if err := btx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{"exec", "exec-no-args", "exec-no-args-2", "query", "copy-from", "last"}
	if got := r.effectIDs(t); !slices.Equal(got, want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
	for i, c := range calls {
		res, ok, err := r.store.Find(ctx, rs[i].Key)
		if err != nil || ok != c.wantRecord || (ok && string(res.Outcome) != c.name) {
			t.Errorf("%s: Find: %+v, %v, %v; want a record %v", c.name, res, ok, err, c.wantRecord)
		}
	}
	if n := r.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}
}

// A batch whose calls each write one row costs a round trip per call and two
// more: the probe with BEGIN, and the records with COMMIT.
func TestBatchRoundTrips(t *testing.T) {
	tracer := &roundTrips{}
	r := batchReplica(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = tracer
		c.MaxConns = 2
	})
	ctx := context.Background()
	run := func(prefix string, n int) {
		t.Helper()
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("%s-%d", prefix, i)
		}
		_, btx, err := r.store.BeginBatch(ctx, reservations(names...))
		if err != nil {
			t.Fatal(err)
		}
		defer btx.Rollback(ctx)
		for i, name := range names {
			hctx := btx.HandlerContext(ctx, i)
			if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, name); err != nil {
				t.Fatal(err)
			}
			if err := btx.Record(ctx, i, []byte("ok"), true); err != nil {
				t.Fatal(err)
			}
		}
		if err := btx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	run("warm-up-a", 32)
	run("warm-up-b", 32)
	tracer.reset()
	run("k", 32)
	if rt, p := tracer.reset(); rt != 34 || p != 0 {
		t.Errorf("a batch of 32: %d round trips, %d prepares; want 34 (begin and probe, 32 inserts, records and commit), 0", rt, p)
	}
}

// A handler's statement that fails to parse: with pgx's statement cache
// (the default), the statement is prepared before the pipeline that
// carries the call's savepoint runs, and fails it whole, savepoint and all:
// the batch cannot undo that call alone, so it fails, and nothing of it
// commits. In pgx's exec and simple modes (behind pgbouncer) the savepoint
// is set first, and the call is undone alone. Either way no other call's
// write is undone, and nothing is half committed.
func TestBatchUnparsableStatement(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	rs := reservations("a", "b", "c")
	_, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	hctx := btx.HandlerContext(ctx, 0)
	if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, "a"); err != nil {
		t.Fatal(err)
	}
	if err := btx.Record(ctx, 0, []byte("ok"), true); err != nil {
		t.Fatal(err)
	}
	hctx = btx.HandlerContext(ctx, 1)
	if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO no_such_table VALUES ($1)`, "b"); err == nil {
		t.Fatal("an insert into a missing table succeeded")
	}
	recordErr := btx.Record(ctx, 1, []byte("failed"), false)
	if failed := btx.Err() != nil; failed != (recordErr != nil) {
		t.Fatalf("Record: %v, Err: %v", recordErr, btx.Err())
	}
	if btx.Err() != nil {
		if err := btx.Commit(ctx); err == nil {
			t.Fatal("the failed batch committed")
		}
		if got := r.effectIDs(t); len(got) != 0 {
			t.Fatalf("effects %v, want none", got)
		}
		if n := r.count(t, "true"); n != 0 {
			t.Fatalf("%d records, want none", n)
		}
	} else {
		hctx = btx.HandlerContext(ctx, 2)
		if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, "c"); err != nil {
			t.Fatal(err)
		}
		if err := btx.Record(ctx, 2, []byte("ok"), true); err != nil {
			t.Fatal(err)
		}
		if err := btx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := r.effectIDs(t); !slices.Equal(got, []string{"a", "c"}) {
			t.Fatalf("effects %v, want a and c", got)
		}
		if n := r.count(t, "true"); n != 3 {
			t.Fatalf("%d records, want 3", n)
		}
	}
	if n := r.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}
}

// A statement whose argument pgx cannot encode: in the simple protocol it
// never leaves the process, and the call's savepoint goes out with its next
// statement, the other calls kept; in a pipeline (pgx's statement cache,
// and exec mode) pgx closes the connection, whose pipeline it cannot
// finish, and the batch fails with nothing committed. Nothing is half
// committed either way.
func TestBatchUnsentStatement(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	rs := reservations("a", "b")
	_, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	hctx := btx.HandlerContext(ctx, 0)
	if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, "a"); err != nil {
		t.Fatal(err)
	}
	if err := btx.Record(ctx, 0, []byte("ok"), true); err != nil {
		t.Fatal(err)
	}
	hctx = btx.HandlerContext(ctx, 1)
	q := querier(t, hctx)
	if _, err := q.Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, make(chan int)); err == nil {
		t.Fatal("a channel was encoded")
	}
	_, err = q.Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, "b")
	recordErr := btx.Record(ctx, 1, []byte("failed"), false)
	if btx.Err() != nil {
		if err == nil || recordErr == nil || btx.Commit(ctx) == nil {
			t.Fatalf("the batch failed (%v), but the next statement (%v), Record (%v) or Commit succeeded", btx.Err(), err, recordErr)
		}
		if got := r.effectIDs(t); len(got) != 0 {
			t.Fatalf("effects %v, want none", got)
		}
		return
	}
	if err != nil || recordErr != nil {
		t.Fatalf("the next statement: %v, Record: %v", err, recordErr)
	}
	if err := btx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := r.effectIDs(t); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("effects %v, want a", got)
	}
}

// A record written by another call after the batch's probe (a two-phase
// reservation, which takes no advisory lock) fails the whole commit with
// ErrLeaseLost, and nothing of the batch commits.
func TestBatchCommitLost(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	rs := reservations("a", "b")
	_, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	for i := range rs {
		hctx := btx.HandlerContext(ctx, i)
		if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ($1)`, fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
		if err := btx.Record(ctx, i, []byte("ok"), true); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := r.store.Reserve(ctx, rs[1]); err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve: %+v, %v", res, err)
	}
	if err := btx.Commit(ctx); !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("Commit: %v, want ErrLeaseLost", err)
	}
	if got := r.effectIDs(t); len(got) != 0 {
		t.Fatalf("effects %v, want none", got)
	}
	if _, ok, _ := r.store.Find(ctx, rs[0].Key); ok {
		t.Fatal("the other key of the lost batch was recorded")
	}
}

// A handler that commits the batch's transaction itself has committed the
// writes of the calls before it: their outcomes are recorded after the
// fact, and the batch fails, so that its caller decides each call again
// and finds them recorded.
func TestBatchHandlerCommits(t *testing.T) {
	r := batchReplica(t)
	ctx := context.Background()
	rs := reservations("a", "b", "c")
	_, btx, err := r.store.BeginBatch(ctx, rs)
	if err != nil {
		t.Fatal(err)
	}
	defer btx.Rollback(ctx)
	hctx := btx.HandlerContext(ctx, 0)
	if _, err := querier(t, hctx).Exec(hctx, `INSERT INTO effects (id) VALUES ('a')`); err != nil {
		t.Fatal(err)
	}
	if err := btx.Record(ctx, 0, []byte("a"), true); err != nil {
		t.Fatal(err)
	}
	hctx = btx.HandlerContext(ctx, 1)
	q := querier(t, hctx)
	if _, err := q.Exec(hctx, `INSERT INTO effects (id) VALUES ('b')`); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Exec(hctx, `COMMIT`); err != nil {
		t.Fatal(err)
	}
	if err := btx.Record(ctx, 1, []byte("b"), true); err == nil || btx.Err() == nil || !strings.Contains(err.Error(), "committed") {
		t.Fatalf("Record: %v, want the batch failed, saying the handler committed", err)
	}
	if err := btx.Commit(ctx); err == nil {
		t.Fatal("Commit after the handler's COMMIT succeeded")
	}
	for i, want := range []bool{true, true, false} {
		if _, ok, err := r.store.Find(ctx, rs[i].Key); ok != want || err != nil {
			t.Errorf("call %d: recorded %v (%v), want %v", i, ok, err, want)
		}
	}
	if got := r.effectIDs(t); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("effects %v", got)
	}
	if n := r.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}
}

// With every transaction slot taken, and no connection to lend (two
// connections, the running call's and the last free), a batch is answered
// from a probe on its own when it acquires nothing, and otherwise waits for
// a slot.
func TestBatchSlots(t *testing.T) {
	r := batchReplica(t, func(c *pgxpool.Config) { c.MaxConns = 2 })
	st := newStore(t, r.pool, postgres.WithAtomicConns(1))
	ctx := context.Background()
	res, tx, err := st.Begin(ctx, reservations("recorded")[0])
	if err != nil || res.State != store.Acquired {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx, []byte("ok"), true); err != nil {
		t.Fatal(err)
	}
	_, running, err := st.Begin(ctx, reservations("running")[0])
	if err != nil || running == nil {
		t.Fatal(err)
	}
	results, btx, err := st.BeginBatch(ctx, reservations("recorded", "running"))
	if err != nil || btx != nil || results[0].State != store.Completed || results[1].State != store.Held {
		t.Fatalf("with no slot free: %+v, %v, %v; want answered at once", results, btx, err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, _, err := st.BeginBatch(short, reservations("free")); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("a free key with no slot free: %v, want it to wait for one until its context ends", err)
	}
	if n := postgres.Probed(st); n != 2 {
		t.Errorf("%d batches probed on their own, want 2", n)
	}
	running.Rollback(ctx)
	results, btx, err = st.BeginBatch(ctx, reservations("free", "running"))
	if err != nil || btx == nil || results[0].State != store.Acquired || results[1].State != store.Acquired {
		t.Fatalf("once the slot is free: %+v, %v", results, err)
	}
	btx.Rollback(ctx)
}
