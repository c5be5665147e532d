package postgres_test

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m, dropFilled)
}

const (
	lease     = 10 * time.Second
	retention = time.Hour
)

var fpA = store.Fingerprint{1}

// replica is one server process's view of the test schema: its own pool and
// store.
type replica struct {
	pool  *pgxpool.Pool
	store *postgres.Store
}

// openPool opens the pools of newReplicas: on the test database, or, in
// TestPgbouncer, through pgbouncer.
var openPool = pgtest.Pool

// newReplicas migrates a fresh schema and returns n replicas on it.
func newReplicas(t testing.TB, n int, configure ...func(*pgxpool.Config)) []replica {
	t.Helper()
	schema := pgtest.Schema(t)
	rs := make([]replica, n)
	for i := range rs {
		pool := openPool(t, schema, configure...)
		if i == 0 {
			if err := postgres.Migrate(context.Background(), pool); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
		}
		rs[i] = replica{pool, newStore(t, pool)}
	}
	return rs
}

// newStore returns a store on pool, failing the test on a bad option.
func newStore(tb testing.TB, pool *pgxpool.Pool, opts ...postgres.Option) *postgres.Store {
	tb.Helper()
	st, err := postgres.New(pool, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return st
}

// unreachableStore returns a store whose database never answers: nothing
// listens on its port. It was built without the schema check, as a server
// whose database went away after it started.
func unreachableStore(t *testing.T) *postgres.Store {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return newStore(t, pool, postgres.WithoutSchemaCheck())
}

func newReplica(t testing.TB, configure ...func(*pgxpool.Config)) replica {
	return newReplicas(t, 1, configure...)[0]
}

// advance moves the database's view of time forward by d for the test
// schema's rows, records and steps: it shifts their timestamps back, so
// now() stays the only clock.
func (r replica) advance(t *testing.T, d time.Duration) {
	t.Helper()
	_, err := r.pool.Exec(context.Background(), `WITH steps AS (UPDATE idempotency_keys_steps SET
		started_at = started_at - $1 * interval '1 microsecond',
		expires_at = expires_at - $1 * interval '1 microsecond')
	UPDATE idempotency_keys SET
		lease_end = lease_end - $1 * interval '1 microsecond',
		created_at = created_at - $1 * interval '1 microsecond',
		expires_at = expires_at - $1 * interval '1 microsecond'`, d.Microseconds())
	if err != nil {
		t.Fatalf("advance: %v", err)
	}
}

func (r replica) count(t *testing.T, where string) int {
	t.Helper()
	var n int
	if err := r.pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func reserve(t *testing.T, st *postgres.Store, key store.Key, fp store.Fingerprint) store.Entry {
	t.Helper()
	res, err := st.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: fp, Lease: lease, Retention: retention})
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	return res
}

func acquire(t *testing.T, st *postgres.Store, key store.Key) store.Token {
	t.Helper()
	res := reserve(t, st, key, fpA)
	if res.State != store.Acquired {
		t.Fatalf("Reserve = %v, want acquired", res.State)
	}
	return res.Token
}

// TestConformance runs the suite on a store that listens (Listen), so that
// every reservation that finds a key held marks it, and Watch is tested.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		r := newReplica(t)
		var shifted atomic.Int64
		postgres.SetClockOffset(r.store, func() time.Duration { return time.Duration(shifted.Load()) })
		listen(t, r.store)
		advance := func(t *testing.T, d time.Duration) {
			r.advance(t, d)
			shifted.Add(int64(d))
		}
		return storetest.Harness{Store: r.store, Advance: advance, ShiftsRecords: true}
	})
}

// Four replicas, each with its own pool, race for one key: exactly one runs.
func TestReplicasRace(t *testing.T) {
	rs := newReplicas(t, 4)
	key := store.ScopeKey("tenant", "/m", "k")
	const callers = 50
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		mu     sync.Mutex
		states = map[store.State]int{}
	)
	for i := range callers {
		wg.Go(func() {
			<-start
			res, err := rs[i%len(rs)].store.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
			if err != nil {
				t.Errorf("Reserve: %v", err)
				return
			}
			mu.Lock()
			states[res.State]++
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	if states[store.Acquired] != 1 || states[store.Held] != callers-1 {
		t.Errorf("50 reserves of one key over 4 replicas: %v; want 1 acquired, 49 in progress", states)
	}
}

// Under a storm of reserves of one key from four replicas, whose holders
// release or complete it with a retention of milliseconds, while a sweeper
// deletes what expires: no reserve fails (a row that is gone between a
// statement's snapshot and its insert is retried, not reported), and no two
// callers ever hold the key at once.
func TestChurn(t *testing.T) {
	rs := newReplicas(t, 4)
	key := store.ScopeKey("tenant", "/m", "k")
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var (
		sweeper           sync.WaitGroup
		holders, acquired atomic.Int32
		swept             atomic.Int64
	)
	sweeper.Go(func() {
		for ctx.Err() == nil {
			n, err := rs[0].store.Sweep(ctx, 10)
			if err != nil && ctx.Err() == nil {
				t.Errorf("Sweep: %v", err)
			}
			swept.Add(int64(n))
		}
	})
	var callers sync.WaitGroup
	for i := range 8 {
		callers.Go(func() {
			st := rs[i%len(rs)].store
			for j := range 100 {
				res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: 2 * time.Millisecond})
				if err != nil {
					t.Errorf("Reserve: %v", err)
					return
				}
				if res.State != store.Acquired {
					continue
				}
				acquired.Add(1)
				if n := holders.Add(1); n != 1 {
					t.Errorf("%d callers hold the key at once", n)
				}
				time.Sleep(100 * time.Microsecond)
				holders.Add(-1)
				if j%2 == 0 {
					err = st.Release(ctx, key, res.Token)
				} else {
					err = st.Complete(ctx, key, res.Token, []byte("ok"))
				}
				if err != nil {
					t.Errorf("Release or Complete: %v", err)
					return
				}
			}
		})
	}
	callers.Wait()
	stop()
	sweeper.Wait()
	if acquired.Load() < 8 {
		t.Errorf("only %d of 800 reserves acquired the key; the storm did not churn", acquired.Load())
	}
	t.Logf("%d acquired, %d swept", acquired.Load(), swept.Load())
}

// Under a default isolation of SERIALIZABLE, a reserve that loses the race
// for a takeover still answers "in progress", not an error.
func TestSerializableDefault(t *testing.T) {
	rs := newReplicas(t, 4, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	key := store.ScopeKey("tenant", "/m", "k")
	acquire(t, rs[0].store, key)
	for round := range 20 {
		rs[0].advance(t, lease+time.Second)
		var (
			wg       sync.WaitGroup
			start    = make(chan struct{})
			acquired atomic.Int32
		)
		for i := range 8 {
			wg.Go(func() {
				<-start
				res, err := rs[i%len(rs)].store.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
				if err != nil {
					t.Errorf("round %d: Reserve: %v", round, err)
				} else if res.State == store.Acquired {
					acquired.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		if n := acquired.Load(); n != 1 {
			t.Fatalf("round %d: %d of 8 takeovers acquired the key, want 1", round, n)
		}
	}
}

// A replica whose lease was taken over by another cannot overwrite the reply
// of the replica that took it over.
func TestTakeoverAcrossReplicas(t *testing.T) {
	rs := newReplicas(t, 2)
	a, b := rs[0], rs[1]
	key := store.ScopeKey("tenant", "/m", "k")
	stale := acquire(t, a.store, key)
	a.advance(t, lease+time.Second)
	fresh := acquire(t, b.store, key)
	if fresh == stale {
		t.Fatalf("takeover reused token %d", fresh)
	}
	if err := a.store.Complete(context.Background(), key, stale, []byte("a")); !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("Complete with the stale token: %v, want ErrLeaseLost", err)
	}
	if err := b.store.Complete(context.Background(), key, fresh, []byte("b")); err != nil {
		t.Fatal(err)
	}
	if res := reserve(t, a.store, key, fpA); res.State != store.Completed || string(res.Outcome) != "b" {
		t.Errorf("replay = %v %q, want completed %q", res.State, res.Outcome, "b")
	}
}

// The lease and expiry are computed from one reading of the database's now()
// in the reserving statement, not from the application's clock.
func TestDatabaseClock(t *testing.T) {
	r := newReplica(t)
	acquire(t, r.store, store.ScopeKey("tenant", "/m", "k"))
	var leaseLen, retentionLen, age float64 // seconds
	err := r.pool.QueryRow(context.Background(), `SELECT
		extract(epoch FROM lease_end - created_at),
		extract(epoch FROM expires_at - created_at),
		extract(epoch FROM clock_timestamp() - created_at)
		FROM idempotency_keys`).Scan(&leaseLen, &retentionLen, &age)
	if err != nil {
		t.Fatal(err)
	}
	if leaseLen != lease.Seconds() || retentionLen != retention.Seconds() {
		t.Errorf("row: lease %vs, retention %vs; want exactly %v and %v", leaseLen, retentionLen, lease, retention)
	}
	if age < 0 || age > 60 {
		t.Errorf("created_at is %vs before the database's clock_timestamp()", age)
	}
}

// Sweep deletes only expired rows, and passes over a row that another session
// has locked instead of waiting for it.
func TestSweepLeavesLiveRows(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	key := func(name string) store.Key { return store.ScopeKey("tenant", "/m", name) }
	running, locked := key("running"), key("locked")
	for _, name := range []string{"done", "running", "locked"} {
		tok := acquire(t, r.store, key(name))
		if name != "running" {
			if err := r.store.Complete(ctx, key(name), tok, []byte(name)); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Retention has passed for all three; "running" still holds a live lease.
	r.advance(t, retention+time.Second)
	if _, err := r.pool.Exec(ctx, `UPDATE idempotency_keys SET lease_end = now() + interval '1 minute' WHERE key = $1`, running[:]); err != nil {
		t.Fatal(err)
	}
	fresh := acquire(t, r.store, key("fresh"))
	if err := r.store.Complete(ctx, key("fresh"), fresh, []byte("fresh")); err != nil {
		t.Fatal(err)
	}

	tx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT FROM idempotency_keys WHERE key = $1 FOR UPDATE`, locked[:]); err != nil {
		t.Fatal(err)
	}
	sweepCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	deleted, err := r.store.Sweep(sweepCtx, 10)
	if err != nil || deleted != 1 {
		t.Fatalf("Sweep with one expired row and one locked expired row = %d, %v; want 1, nil", deleted, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := r.count(t, "true"); n != 3 {
		t.Errorf("%d rows left, want 3 (running, locked, fresh)", n)
	}
	if deleted, err := r.store.Sweep(ctx, 10); err != nil || deleted != 1 {
		t.Errorf("Sweep once the lock is gone = %d, %v; want 1, nil", deleted, err)
	}
}

// A paced sweep rests after each batch (WithSweepShare), so a caller that
// cancels it after its first batch finds the other batches' rows still there;
// a share out of its bounds is refused by New.
func TestSweepPaced(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	for _, share := range []float64{0, 0.009, 1.5, math.NaN()} {
		if _, err := postgres.New(r.pool, postgres.WithSweepShare(share)); err == nil {
			t.Errorf("New with WithSweepShare(%v) succeeded; want an error", share)
		}
	}
	if _, err := r.pool.Exec(ctx, `INSERT INTO idempotency_keys
		SELECT sha256(convert_to('expired-' || i, 'UTF8')), sha256(''), 'completed', i,
			now() - interval '2 days', '\x01', now() - interval '2 days', now() - interval '1 day'
		FROM generate_series(1, 25) AS i`); err != nil {
		t.Fatal(err)
	}
	paced := newStore(t, r.pool, postgres.WithSweepShare(0.01))
	sweepCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		deleted int
		err     error
	}
	done := make(chan result, 1)
	go func() {
		n, err := paced.Sweep(sweepCtx, 10)
		done <- result{n, err}
	}()
	// The first batch's statement takes some milliseconds; its rest, 99
	// times as long, gives this loop time to see it, however busy the machine.
	for r.count(t, "true") == 25 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	got := <-done
	if got.deleted != 10 || !errors.Is(got.err, context.Canceled) {
		t.Errorf("paced Sweep cancelled after its first batch = %d, %v; want 10, context.Canceled", got.deleted, got.err)
	}
	if n := r.count(t, "true"); n != 15 {
		t.Errorf("%d rows left, want 15: a paced sweep rests between batches", n)
	}
	if deleted, err := paced.Sweep(ctx, 10); err != nil || deleted != 15 {
		t.Errorf("the next paced Sweep = %d, %v; want 15, nil", deleted, err)
	}

	// A deadline that would fall within a rest ends the sweep at once, and
	// says so, rather than report a partial sweep as done. The deadline is
	// five times an unpaced sweep of one batch: past the first batch, short
	// of its rest of 99 times the batch.
	expire := func(n int) {
		t.Helper()
		if _, err := r.pool.Exec(ctx, `INSERT INTO idempotency_keys
			SELECT sha256(convert_to('expired-' || $1 || '-' || i, 'UTF8')), sha256(''), 'completed', i,
				now() - interval '2 days', '\x01', now() - interval '2 days', now() - interval '1 day'
			FROM generate_series(1, $2) AS i`, time.Now().String(), n); err != nil {
			t.Fatal(err)
		}
	}
	expire(10)
	start := time.Now()
	if deleted, err := r.store.Sweep(ctx, 10); err != nil || deleted != 10 {
		t.Fatalf("unpaced Sweep of 10 = %d, %v", deleted, err)
	}
	deadline, cancelDeadline := context.WithTimeout(ctx, 5*time.Since(start))
	defer cancelDeadline()
	expire(25)
	deleted, err := paced.Sweep(deadline, 10)
	if !errors.Is(err, context.DeadlineExceeded) || deleted > 10 {
		t.Errorf("paced Sweep with a deadline within its first rest = %d, %v; want at most 10 and context.DeadlineExceeded", deleted, err)
	}
	if n := r.count(t, "true"); n != 25-deleted {
		t.Errorf("%d rows left after deleting %d of 25", n, deleted)
	}
}

// waitBlocked returns the pid of the backend of application name app that is
// waiting on a lock.
func waitBlocked(t *testing.T, pool *pgxpool.Pool, app string) int32 {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var pid int32
		err := pool.QueryRow(context.Background(),
			`SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&pid)
		if err == nil {
			return pid
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
	}
	t.Fatal("the store's statement never blocked on the lock")
	return 0
}

// Killing the store's backend in the middle of a statement (an
// administrator, a restart, a failover) loses only that connection: the
// store runs the statement again on a fresh one, and the call succeeds once
// the database lets it. For Complete that is what keeps a handler's reply
// from being lost, and its key from running again after the lease; for
// FinishStep, a step's result, whose effect has happened.
func TestTerminatedBackend(t *testing.T) {
	for _, during := range []string{"reserve", "complete", "release", "finish step", "renew"} {
		t.Run(during, func(t *testing.T) {
			app := "idemkey_test_" + strings.ReplaceAll(t.Name(), "/", "_")
			victim := newReplica(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
			admin := victim // the admin pool is a separate pool on the same schema
			admin.pool = pgtest.Pool(t, schemaOf(t, victim.pool))
			ctx := context.Background()
			key := store.ScopeKey("tenant", "/m", "k")

			// Another session holds the row (or its insertion) so that the
			// store's statement waits while we terminate its backend.
			var token store.Token
			if during != "reserve" {
				token = acquire(t, victim.store, key)
			}
			if during == "finish step" {
				if _, err := victim.store.StartStep(ctx, store.StepStart{Key: key, Name: "charge", Token: token, Fingerprint: fpA}); err != nil {
					t.Fatal(err)
				}
			}
			blocker, err := admin.pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer blocker.Rollback(ctx)
			if during == "reserve" {
				_, err = blocker.Exec(ctx, `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
					VALUES ($1, $2, 'in_progress', 0, now(), now(), now())`, key[:], fpA[:])
			} else {
				_, err = blocker.Exec(ctx, `SELECT FROM idempotency_keys WHERE key = $1 FOR UPDATE`, key[:])
			}
			if err != nil {
				t.Fatal(err)
			}

			type result struct {
				res store.Entry
				err error
			}
			done := make(chan result, 1)
			go func() {
				var r result
				switch during {
				case "reserve":
					r.res, r.err = victim.store.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
				case "complete":
					r.err = victim.store.Complete(ctx, key, token, []byte("ok"))
				case "finish step":
					r.err = victim.store.FinishStep(ctx, key, token, "charge", []byte("ok"))
				case "renew":
					r.err = victim.store.Renew(ctx, key, token, time.Hour)
				default:
					r.err = victim.store.Release(ctx, key, token)
				}
				done <- r
			}()
			pid := waitBlocked(t, admin.pool, app)
			var terminated bool
			if err := admin.pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&terminated); err != nil || !terminated {
				t.Fatalf("pg_terminate_backend = %v, %v", terminated, err)
			}
			// The statement runs again on another connection, and waits for
			// the blocker like the first did.
			for waitBlocked(t, admin.pool, app) == pid {
				time.Sleep(5 * time.Millisecond)
			}
			if err := blocker.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			if r.err != nil {
				t.Fatalf("%s whose backend was terminated: %v, want it done on another connection", during, r.err)
			}
			res := reserve(t, victim.store, key, fpA)
			switch during {
			case "reserve":
				if r.res.State != store.Acquired {
					t.Errorf("Reserve = %v, want acquired", r.res.State)
				}
			case "complete":
				if res.State != store.Completed || string(res.Outcome) != "ok" {
					t.Errorf("after Complete: %v %q, want the recorded outcome", res.State, res.Outcome)
				}
			case "finish step":
				step, err := victim.store.StartStep(ctx, store.StepStart{Key: key, Name: "charge", Token: token, Fingerprint: fpA})
				if err != nil || step.State != store.StepDone || string(step.Result) != "ok" {
					t.Errorf("after FinishStep: %+v, %v; want the recorded result", step, err)
				}
			case "renew":
				if res.State != store.Held || res.RetryAfter < time.Hour-time.Minute {
					t.Errorf("after Renew: %v, %v left; want held, about an hour left", res.State, res.RetryAfter)
				}
			default:
				if res.State != store.Acquired {
					t.Errorf("after Release: %v, want the key free", res.State)
				}
			}
		})
	}
}

// A write whose answer is lost with its connection, after the database
// carried it out, runs again on a fresh connection and finds its own effect:
// success, not ErrLeaseLost, and nothing written twice.
func TestWriteRetryFindsItsOwnEffect(t *testing.T) {
	for _, op := range []string{"complete", "release"} {
		t.Run(op, func(t *testing.T) {
			var cut atomic.Bool
			r := newReplica(t, func(c *pgxpool.Config) {
				c.MaxConns = 1 // one connection, whose statements pgx has prepared
				dial := c.ConnConfig.DialFunc
				c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
					conn, err := dial(ctx, network, addr)
					return &cuttableConn{Conn: conn, cut: &cut}, err
				}
			})
			ctx := context.Background()
			// Complete and Release once each, so that the connection has
			// prepared their statements: the next write is the execution.
			for _, k := range []string{"warm-1", "warm-2"} {
				key := store.ScopeKey("tenant", "/m", k)
				token := acquire(t, r.store, key)
				if err := r.store.Complete(ctx, key, token, []byte("ok")); err != nil {
					t.Fatal(err)
				}
				if err := r.store.Release(ctx, key, token); !errors.Is(err, store.ErrLeaseLost) {
					t.Fatal(err)
				}
			}
			key := store.ScopeKey("tenant", "/m", "done-unseen")
			token := acquire(t, r.store, key)
			cut.Store(true)
			var err error
			if op == "complete" {
				err = r.store.Complete(ctx, key, token, []byte("ok"))
			} else {
				err = r.store.Release(ctx, key, token)
			}
			if cut.Load() {
				t.Fatal("the connection was never cut")
			}
			if err != nil {
				t.Fatalf("%s whose answer was lost: %v, want success", op, err)
			}
			res := reserve(t, r.store, key, fpA)
			if op == "complete" && (res.State != store.Completed || string(res.Outcome) != "ok") {
				t.Errorf("after Complete: %v %q, want the recorded outcome", res.State, res.Outcome)
			}
			if op == "release" && res.State != store.Acquired {
				t.Errorf("after Release: %v, want the key free", res.State)
			}
		})
	}
}

// cuttableConn is a connection to PostgreSQL that, once cut is set, lets the
// next statement through and then drops the server's answer to it and closes,
// as a network that fails at the worst moment does.
type cuttableConn struct {
	net.Conn
	cut     *atomic.Bool
	pending bool
}

func (c *cuttableConn) Write(b []byte) (int, error) {
	if c.cut.Load() {
		c.pending = true
	}
	return c.Conn.Write(b)
}

func (c *cuttableConn) Read(b []byte) (int, error) {
	if !c.pending {
		return c.Conn.Read(b)
	}
	_, _ = c.Conn.Read(b) // the answer: the statement has run and committed
	c.pending = false
	c.cut.Store(false)
	c.Conn.Close()
	return 0, io.ErrUnexpectedEOF
}

func schemaOf(t *testing.T, pool *pgxpool.Pool) string {
	return pool.Config().ConnConfig.RuntimeParams["search_path"]
}

// Errors reach the caller translated: unreachable and timed-out databases are
// ErrUnavailable, other server errors keep their SQLSTATE, and no pgx error
// value gets through.
func TestErrors(t *testing.T) {
	ctx := context.Background()
	key := store.ScopeKey("tenant", "/m", "k")
	res := store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention}

	t.Run("unreachable", func(t *testing.T) {
		_, err := unreachableStore(t).Reserve(ctx, res)
		wantTranslated(t, err, true)
		if msg := err.Error(); strings.Contains(msg, "127.0.0.1") || strings.Contains(msg, "user=") {
			t.Errorf("error names the connection: %s", msg)
		}
	})
	t.Run("timeout", func(t *testing.T) {
		r := newReplica(t)
		st := newStore(t, r.pool, postgres.WithTimeout(100*time.Millisecond))
		blocker, err := r.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer blocker.Rollback(ctx)
		if _, err := blocker.Exec(ctx, `LOCK TABLE idempotency_keys`); err != nil {
			t.Fatal(err)
		}
		_, err = st.Reserve(ctx, res)
		wantTranslated(t, err, true)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("timed-out Reserve: %v, want it to match context.DeadlineExceeded too", err)
		}
	})
	t.Run("dropped table", func(t *testing.T) {
		r := newReplica(t)
		if _, err := r.pool.Exec(ctx, `DROP TABLE idempotency_keys`); err != nil {
			t.Fatal(err)
		}
		_, err := r.store.Reserve(ctx, res)
		wantTranslated(t, err, false)
		for _, want := range []string{"42P01", "the store's table or its sequence is gone", "`idemkey migrate up -database-url URL`"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Reserve on a dropped table: %v, want %q in the message", err, want)
			}
		}
	})
	t.Run("bad table name", func(t *testing.T) {
		for _, name := range []string{"", "Keys", "a.b.c", ".keys", "keys.", "keys; DROP TABLE x", strings.Repeat("k", 49)} {
			if _, err := postgres.New(nil, postgres.WithTable(name)); err == nil {
				t.Errorf("New with table %q: no error", name)
			}
		}
	})
}

func wantTranslated(t *testing.T, err error, unavailable bool) {
	t.Helper()
	if err == nil {
		t.Fatal("no error")
	}
	if errors.Is(err, store.ErrUnavailable) != unavailable {
		t.Errorf("error %q: errors.Is(ErrUnavailable) = %v, want %v", err, !unavailable, unavailable)
	}
	var pgErr *pgconn.PgError
	var connErr *pgconn.ConnectError
	if errors.As(err, &pgErr) || errors.As(err, &connErr) {
		t.Errorf("a raw pgx error reached the caller: %v", err)
	}
}

// WithTable puts the table, its sequence, its index and the table of steps
// under another name in another schema, and Migrate is safe to run twice.
func TestWithTable(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, "public")
	schema := pgtest.Schema(t)
	opt := postgres.WithTable(schema + ".idem")
	for range 2 {
		if err := postgres.Migrate(ctx, pool, opt); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
	}
	st := newStore(t, pool, opt)
	key := store.ScopeKey("tenant", "/m", "k")
	token := acquire(t, st, key)
	if _, err := st.StartStep(ctx, store.StepStart{Key: key, Name: "charge", Token: token, Fingerprint: fpA}); err != nil {
		t.Fatal(err)
	}
	if err := st.Complete(ctx, key, token, []byte("ok")); err != nil {
		t.Fatal(err)
	}
	rows, _ := pool.Query(ctx, `SELECT relname FROM pg_class WHERE relnamespace = $1::regnamespace ORDER BY relname`, schema)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := "idem idem_expires_at_idx idem_migrations idem_migrations_pkey idem_outbox idem_outbox_order idem_outbox_pending idem_outbox_pkey idem_outbox_sent idem_outbox_seq_seq " +
		"idem_pkey idem_steps idem_steps_exp_idx idem_steps_pkey idem_token_seq"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("objects in the schema: %s\nwant %s", got, want)
	}
}

// Replicas starting together on an empty database all migrate without error.
func TestMigrateConcurrently(t *testing.T) {
	for range 5 {
		pool := pgtest.Pool(t, pgtest.Schema(t))
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				if err := postgres.Migrate(context.Background(), pool); err != nil {
					t.Errorf("concurrent Migrate: %v", err)
				}
			})
		}
		wg.Wait()
	}
}

// Migrations is what Migrate applies: the down files, newest first, undo
// the up files.
func TestMigrationsRoundTrip(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	ups, err := fs.Glob(postgres.Migrations, "*.up.sql")
	if err != nil || len(ups) < 2 {
		t.Fatalf("migrations %q, %v", ups, err)
	}
	names := slices.Clone(ups)
	for _, up := range slices.Backward(ups) {
		names = append(names, strings.TrimSuffix(up, ".up.sql")+".down.sql")
	}
	for _, name := range names {
		sql, err := fs.ReadFile(postgres.Migrations, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, string(sql)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace`).Scan(&n); err != nil || n != 0 {
		t.Errorf("after up and down: %d objects left, %v", n, err)
	}
}

// MigrationStatus follows Migrate and MigrateDown, which undoes it, for a
// table in a schema of its own as for the default.
func TestMigrateDown(t *testing.T) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t, schema)
	for _, table := range []string{postgres.DefaultTable, schema + ".other_keys"} {
		opt := postgres.WithTable(table)
		applied := func() int {
			t.Helper()
			states, err := postgres.MigrationStatus(ctx, pool, opt)
			if err != nil || len(states) == 0 {
				t.Fatalf("MigrationStatus = %v, %v", states, err)
			}
			n := 0
			for _, st := range states {
				if !st.Known {
					t.Errorf("migration %s unknown", st.Name)
				}
				if !st.Applied.IsZero() {
					n++
				}
			}
			return n
		}
		if n := applied(); n != 0 {
			t.Fatalf("%s: %d migrations applied before Migrate", table, n)
		}
		if err := postgres.Migrate(ctx, pool, opt); err != nil {
			t.Fatal(err)
		}
		all := applied()
		reverted, err := postgres.MigrateDown(ctx, pool, 0, opt)
		if err != nil || len(reverted) != all {
			t.Fatalf("%s: MigrateDown = %v, %v; want all %d reverted", table, reverted, err, all)
		}
		if n := applied(); n != 0 {
			t.Errorf("%s: %d migrations applied after MigrateDown to 0", table, n)
		}
		if _, err := postgres.New(pool, opt); err == nil {
			t.Errorf("%s: New after MigrateDown to 0 found a table", table)
		}
	}
}
