package pgshard_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
)

// The store suite runs on pgshard over three databases in store/postgres's
// tests (TestShardedConformance), which can move a shard's Watch clock; the
// adapter suite, in every adapter's (internal/adaptertest).

func TestMain(m *testing.M) { leakcheck.Main(m) }

const method = "/test.v1.Payments/Charge"

// rig is a pgshard store over three databases (pgtest.ShardPools), each
// with a charges table of the application's beside the store's.
type rig struct {
	pools []*pgxpool.Pool
	st    *pgshard.Store
}

func newRig(t *testing.T, opts ...pgshard.Option) *rig {
	t.Helper()
	return newRigWith(t, nil, opts...)
}

// newRigWith is newRig with more shards after the three, such as downStore.
func newRigWith(t *testing.T, more []*postgres.Store, opts ...pgshard.Option) *rig {
	t.Helper()
	r := &rig{pools: pgtest.ShardPools(t)}
	shards := make([]*postgres.Store, len(r.pools), len(r.pools)+len(more))
	for i, pool := range r.pools {
		if err := postgres.Migrate(t.Context(), pool); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
		if _, err := pool.Exec(t.Context(), `CREATE TABLE charges (key text PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		st, err := postgres.New(pool)
		if err != nil {
			t.Fatal(err)
		}
		shards[i] = st
	}
	var err error
	if r.st, err = pgshard.New(append(shards, more...), opts...); err != nil {
		t.Fatal(err)
	}
	return r
}

// downStore is a shard whose database never answers: its pool's address
// refuses every connection.
func downStore(t *testing.T) *postgres.Store {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), "postgres://postgres@127.0.0.1:1/test") // never connected
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st, err := postgres.New(pool, postgres.WithoutSchemaCheck())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

type tenantKey struct{}

// engine is an engine on the rig's store that reads the tenant from the
// call's context, and its operation in the mode asked.
func (r *rig) engine(t *testing.T, atomic bool) (*engine.Engine, *engine.Operation) {
	t.Helper()
	e, err := engine.New(r.st, engine.WithTenant(func(ctx context.Context) (string, error) {
		return ctx.Value(tenantKey{}).(string), nil
	}), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	op, err := e.Operation(engine.OperationSpec{Name: method, Atomic: atomic})
	if err != nil {
		t.Fatal(err)
	}
	return e, op
}

// count is how many rows of table shard i holds whose key is one of keys
// (all of them without keys).
func (r *rig) count(t *testing.T, i int, table string, keys ...[]byte) int {
	t.Helper()
	var n int
	sql, args := `SELECT count(*) FROM `+table, []any{}
	if keys != nil {
		sql, args = sql+` WHERE key = ANY($1)`, []any{keys}
	}
	if err := r.pools[i].QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// charge is a call of the charge operation: its handler writes a charges
// row through the call's transaction in atomic mode, and fails (released)
// if fail is set.
type charge struct {
	key      string
	fail     bool
	ran      bool
	answered engine.Answer
}

func (c *charge) Key() (string, bool, error) { return c.key, true, nil }
func (c *charge) FirstSent() []string        { return nil }
func (c *charge) FirstRegion() []string      { return nil }
func (c *charge) Attempt() engine.Attempt    { return engine.Attempt{} }
func (c *charge) Fingerprint(context.Context) (store.Fingerprint, error) {
	return store.Fingerprint{1}, nil
}
func (c *charge) StandIn(error) []byte                          { return []byte("stand-in") }
func (c *charge) Pass(context.Context) int                      { c.ran = true; return 0 }
func (c *charge) Answer(_ context.Context, a engine.Answer) int { c.answered = a; return 0 }

func (c *charge) Run(ctx context.Context) engine.HandlerResult {
	c.ran = true
	if tx, ok := postgres.TxFromContext(ctx); ok {
		if _, err := tx.Exec(ctx, `INSERT INTO charges (key) VALUES ($1)`, c.key); err != nil {
			return engine.HandlerResult{Release: true}
		}
	}
	if c.fail {
		return engine.HandlerResult{Release: true}
	}
	return engine.HandlerResult{Record: []byte("charged " + c.key), KeepWrites: true}
}

func serve(e *engine.Engine, op *engine.Operation, tenant string, c *charge) *charge {
	e.Serve(context.WithValue(context.Background(), tenantKey{}, tenant), op, c)
	return c
}

// keysOf are the store's keys of tenant's charges keys.
func keysOf(tenant string, keys ...string) [][]byte {
	out := make([][]byte, len(keys))
	for i, k := range keys {
		sk := store.ScopeKey(tenant, method, k)
		out[i] = sk[:]
	}
	return out
}

// TestTenantOnOneShard: every record of a tenant lands on its shard
// (ShardOf), and is replayed from there; WithTenants puts a tenant where
// it says; the tenants spread over every shard.
func TestTenantOnOneShard(t *testing.T) {
	r := newRig(t, pgshard.WithTenants(map[string]int{"pinned": 2}))
	e, op := r.engine(t, false)
	tenants := []string{"pinned"}
	for i := range 12 {
		tenants = append(tenants, fmt.Sprint("tenant-", i))
	}
	keys := []string{"k1", "k2", "k3", "k4"}
	used := map[int]bool{}
	for _, tenant := range tenants {
		for _, k := range keys {
			if c := serve(e, op, tenant, &charge{key: k}); c.answered.Verdict != engine.Executed {
				t.Fatalf("%s %s: %v, want executed", tenant, k, c.answered.Verdict)
			}
			if c := serve(e, op, tenant, &charge{key: k}); c.answered.Verdict != engine.Replayed || c.ran {
				t.Fatalf("%s %s again: %v (ran %v), want replayed", tenant, k, c.answered.Verdict, c.ran)
			}
		}
		home := r.st.ShardOf(tenant)
		used[home] = true
		for i := range r.pools {
			want := 0
			if i == home {
				want = len(keys)
			}
			if n := r.count(t, i, "idempotency_keys", keysOf(tenant, keys...)...); n != want {
				t.Errorf("%s: shard %d holds %d of its %d records, want %d (its shard is %d)", tenant, i, n, len(keys), want, home)
			}
		}
	}
	if home := r.st.ShardOf("pinned"); home != 2 {
		t.Errorf("ShardOf a tenant WithTenants puts on shard 2 = %d", home)
	}
	if len(used) != len(r.pools) {
		t.Errorf("13 tenants used shards %v, want all %d", used, len(r.pools))
	}
}

// TestMovingRefused: a call of a tenant being moved is answered
// StoreUnavailable, without running its handler, and writes nothing on any
// shard; another tenant's call runs.
func TestMovingRefused(t *testing.T) {
	r := newRig(t, pgshard.WithMoving("moving"))
	for _, atomic := range []bool{false, true} {
		e, op := r.engine(t, atomic)
		c := serve(e, op, "moving", &charge{key: fmt.Sprint("k-", atomic)})
		if c.answered.Verdict != engine.StoreUnavailable || c.ran {
			t.Errorf("atomic %v: a moving tenant's call: %v (ran %v), want store_unavailable, not run", atomic, c.answered.Verdict, c.ran)
		}
		if c := serve(e, op, "staying", &charge{key: fmt.Sprint("k-", atomic)}); c.answered.Verdict != engine.Executed {
			t.Errorf("atomic %v: another tenant's call: %v, want executed", atomic, c.answered.Verdict)
		}
	}
	for i := range r.pools {
		if n := r.count(t, i, "idempotency_keys", keysOf("moving", "k-false", "k-true")...); n != 0 {
			t.Errorf("shard %d holds %d records of the moving tenant, want none", i, n)
		}
	}
	ctx := store.ContextWithPartition(t.Context(), store.TenantPartition("moving"))
	_, _, err := r.st.Find(ctx, store.ScopeKey("moving", method, "k"))
	if !errors.Is(err, pgshard.ErrMoving) || !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Find of a moving tenant: %v, want ErrMoving, a store.ErrUnavailable", err)
	}
	batch := []store.Reservation{
		{Key: store.ScopeKey("staying", method, "b"), Lease: time.Minute, Retention: time.Hour, Partition: store.TenantPartition("staying")},
		{Key: store.ScopeKey("moving", method, "b"), Lease: time.Minute, Retention: time.Hour, Partition: store.TenantPartition("moving")},
	}
	res, err := r.st.ReserveBatch(t.Context(), batch)
	var partial *store.PartialError
	if !errors.As(err, &partial) || !errors.Is(err, pgshard.ErrMoving) || !slices.Equal(partial.Failed, []bool{false, true}) {
		t.Fatalf("ReserveBatch with a moving tenant's reservation: %v, want a PartialError of ErrMoving for it alone", err)
	}
	if res[0].State != store.Acquired {
		t.Errorf("ReserveBatch: the staying tenant's reservation %v, want acquired", res[0].State)
	}
	if n := r.count(t, r.st.ShardOf("staying"), "idempotency_keys", keysOf("staying", "b")...); n != 1 {
		t.Errorf("the batch reserved %d of the staying tenant's keys, want its one", n)
	}
	if _, err := r.st.ReserveBatch(t.Context(), batch[1:]); !errors.Is(err, pgshard.ErrMoving) || errors.As(err, &partial) {
		t.Errorf("ReserveBatch of a moving tenant's reservation alone: %v, want ErrMoving, not partial", err)
	}
}

// TestServeBatchPartial: a consumer's batch holding a message of a tenant
// being moved, or of a shard that is down, between two of a tenant on a
// healthy shard, served together in either mode: the healthy tenant's
// messages run and are recorded on its shard (in atomic mode with their
// charges), and the other is answered store_unavailable, not run, nothing
// of it written; redelivered, the first replay and the other is refused
// again.
func TestServeBatchPartial(t *testing.T) {
	for _, tc := range []struct {
		name, trouble string
		rig           func(t *testing.T) *rig
	}{
		{"moving", "moving", func(t *testing.T) *rig {
			return newRig(t, pgshard.WithMoving("moving"), pgshard.WithTenants(map[string]int{"healthy": 0, "moving": 0}))
		}},
		{"shard down", "down", func(t *testing.T) *rig {
			return newRigWith(t, []*postgres.Store{downStore(t)}, pgshard.WithTenants(map[string]int{"healthy": 0, "down": 3}))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.rig(t)
			for _, atomic := range []bool{false, true} {
				e, op := r.consumer(t, atomic)
				tenants := []string{"healthy", tc.trouble, "healthy"}
				suffix := fmt.Sprint("-", atomic)
				keys := []string{"m0" + suffix, "m1" + suffix, "m2" + suffix}
				for round, want := range []engine.Verdict{engine.Executed, engine.Replayed} {
					for i, c := range serveBatch(e, op, tenants, suffix) {
						switch {
						case tenants[i] == tc.trouble && (c.answered.Verdict != engine.StoreUnavailable || c.ran):
							t.Errorf("atomic %v, round %d: the %s tenant's message: %v (ran %v), want store_unavailable, not run",
								atomic, round, tc.trouble, c.answered.Verdict, c.ran)
						case tenants[i] != tc.trouble && (c.answered.Verdict != want || c.ran != (want == engine.Executed)):
							t.Errorf("atomic %v, round %d: the healthy tenant's message %d: %v (ran %v), want %v",
								atomic, round, i, c.answered.Verdict, c.ran, want)
						}
					}
				}
				healthy := [][]byte{[]byte(keys[0]), []byte(keys[2])}
				wantCharges := 0
				if atomic {
					wantCharges = 2
				}
				if n, m := r.count(t, 0, "charges", healthy...), r.count(t, 0, "idempotency_keys", keysOf("healthy", keys[0], keys[2])...); n != wantCharges || m != 2 {
					t.Errorf("atomic %v: the healthy tenant's shard holds %d charges and %d records of its messages, want %d and 2", atomic, n, m, wantCharges)
				}
				for i := range r.pools {
					if n, m := r.count(t, i, "charges", []byte(keys[1])), r.count(t, i, "idempotency_keys", keysOf(tc.trouble, keys[1])...); n != 0 || m != 0 {
						t.Errorf("atomic %v: shard %d holds %d charges and %d records of the %s tenant's message, want none", atomic, i, n, m, tc.trouble)
					}
				}
			}
		})
	}
}

// TestAtomicOnTenantShard: an atomic call's handler writes through its
// tenant's shard's transaction, so its charge and the key's record are both
// on that shard; a released call leaves neither anywhere.
func TestAtomicOnTenantShard(t *testing.T) {
	r := newRig(t)
	e, op := r.engine(t, true)
	tenants := []string{"a", "b", "c", "d", "e", "f"}
	for _, tenant := range tenants {
		key := "charge-" + tenant
		if c := serve(e, op, tenant, &charge{key: key}); c.answered.Verdict != engine.Executed {
			t.Fatalf("%s: %v, want executed", tenant, c.answered.Verdict)
		}
		failed := "failed-" + tenant
		serve(e, op, tenant, &charge{key: failed, fail: true})
		home := r.st.ShardOf(tenant)
		for i := range r.pools {
			want := 0
			if i == home {
				want = 1
			}
			charges := r.count(t, i, "charges", []byte(key), []byte(failed))
			records := r.count(t, i, "idempotency_keys", keysOf(tenant, key, failed)...)
			if charges != want || records != want {
				t.Errorf("%s: shard %d holds %d charges and %d records, want %d of each (its shard is %d)", tenant, i, charges, records, want, home)
			}
		}
	}
}

// TestAtomicBatchAcrossShards: a batch whose calls are of tenants on three
// shards runs each handler in its own shard's transaction, and Commit
// commits every shard: each call's charge and record on its tenant's shard.
func TestAtomicBatchAcrossShards(t *testing.T) {
	r := newRig(t, pgshard.WithTenants(map[string]int{"t0": 0, "t1": 1, "t2": 2, "t2b": 2}))
	tenants := []string{"t2", "t0", "t1", "t2b"}
	rs := make([]store.Reservation, len(tenants))
	for i, tenant := range tenants {
		rs[i] = store.Reservation{Key: store.ScopeKey(tenant, method, "k"), Fingerprint: store.Fingerprint{1},
			Lease: time.Minute, Retention: time.Hour, MaxOutcome: 1024, Partition: store.TenantPartition(tenant)}
	}
	ctx := t.Context()
	res, tx, err := r.st.BeginBatch(ctx, rs)
	if err != nil || tx == nil {
		t.Fatalf("BeginBatch: %v (tx %v)", err, tx)
	}
	for i, tenant := range tenants {
		if res[i].State != store.Acquired {
			t.Fatalf("%s: %v, want acquired", tenant, res[i].State)
		}
		hctx := tx.HandlerContext(ctx, i)
		q, ok := postgres.TxFromContext(hctx)
		if !ok {
			t.Fatalf("%s: the handler's context carries no transaction", tenant)
		}
		if _, err := q.Exec(hctx, `INSERT INTO charges (key) VALUES ($1)`, tenant); err != nil {
			t.Fatal(err)
		}
		if err := tx.Record(ctx, i, []byte("charged"), true); err != nil {
			t.Fatalf("Record: %v", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	want := []int{1, 1, 2} // t0; t1; t2 and t2b
	for i := range r.pools {
		if n, m := r.count(t, i, "charges"), r.count(t, i, "idempotency_keys"); n != want[i] || m != want[i] {
			t.Errorf("shard %d holds %d charges and %d records, want %d of each", i, n, m, want[i])
		}
	}
}

// TestNoPartition: a store call whose context carries no partition is
// refused as the programming error it is, and reaches no shard.
func TestNoPartition(t *testing.T) {
	r := newRig(t)
	err := r.st.Complete(context.Background(), store.ScopeKey("a", method, "k"), 1, []byte("x"))
	if err == nil || !strings.Contains(err.Error(), "no partition") {
		t.Errorf("Complete without a partition: %v, want the programming error", err)
	}
	if _, _, err := r.st.Find(context.Background(), store.ScopeKey("a", method, "k")); err == nil {
		t.Error("Find without a partition succeeded")
	}
}

// TestAddShard: a shard added at the end takes about a quarter of the
// tenants of three shards, each from one of the three, and no other tenant
// moves; WithTenants refuses a shard that does not exist.
func TestAddShard(t *testing.T) {
	shards := make([]*postgres.Store, 4)
	for i := range shards {
		shards[i] = downStore(t)
	}
	three, err := pgshard.New(shards[:3])
	if err != nil {
		t.Fatal(err)
	}
	four, err := pgshard.New(shards)
	if err != nil {
		t.Fatal(err)
	}
	const tenants = 10000
	moved, per := 0, make([]int, 4)
	for i := range tenants {
		tenant := fmt.Sprint("tenant-", i)
		before, after := three.ShardOf(tenant), four.ShardOf(tenant)
		per[after]++
		if before != after {
			moved++
			if after != 3 {
				t.Fatalf("a tenant moved from shard %d to %d, not to the new shard", before, after)
			}
		}
	}
	if moved < tenants/5 || moved > tenants*3/10 {
		t.Errorf("%d of %d tenants moved to the new shard, want about a quarter", moved, tenants)
	}
	for i, n := range per {
		if n < tenants/5 || n > tenants*3/10 {
			t.Errorf("shard %d of 4 has %d of %d tenants, want about a quarter", i, n, tenants)
		}
	}
	if _, err := pgshard.New(shards[:3], pgshard.WithTenants(map[string]int{"secret-tenant": 3})); err == nil || strings.Contains(err.Error(), "secret-tenant") {
		t.Errorf("WithTenants to shard 3 of 3: %v, want an error that does not name the tenant", err)
	}
}

// TestListen: Listen runs every shard's, so that a duplicate's Watch of a
// key held on its tenant's shard is told when the key completes; it
// returns its context's error when that ends.
func TestListen(t *testing.T) {
	r := newRig(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.st.Listen(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != context.Canceled {
			t.Errorf("Listen ended with %v, want its context's error", err)
		}
	}()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ch, stop := r.st.Watch(store.ScopeKey("acme", method, "absent"))
		stop()
		if ch != nil { // nil while a shard does not listen
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the shards never listened")
		}
	}
	pctx := store.ContextWithPartition(t.Context(), store.TenantPartition("acme"))
	res := store.Reservation{Key: store.ScopeKey("acme", method, "k"), Fingerprint: store.Fingerprint{1},
		Lease: time.Minute, Retention: time.Hour, Partition: store.TenantPartition("acme")}
	first, err := r.st.Reserve(pctx, res)
	if err != nil || first.State != store.Acquired {
		t.Fatalf("Reserve: %v, %v", first.State, err)
	}
	if dup, err := r.st.Reserve(pctx, res); err != nil || dup.State != store.Held {
		t.Fatalf("the duplicate's Reserve: %v, %v; want held", dup.State, err)
	}
	changed, stop := r.st.Watch(res.Key)
	defer stop()
	select {
	case <-changed:
		t.Fatal("the Watch of a held key was told at once")
	default:
	}
	if err := r.st.Complete(pctx, res.Key, first.Token, []byte("done")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(30 * time.Second):
		t.Fatal("the Watch was not told of the key's record")
	}
}

// ownCharge is a charge that tells its own tenant, as a consumer's message
// does (engine.OperationSpec.OwnTenant).
type ownCharge struct {
	charge
	tenant string
}

func (c *ownCharge) Tenant() string { return c.tenant }

// consumer is an engine on the rig's store whose operation, in the mode
// asked, reads each call's tenant from the call, as a consumer's does.
func (r *rig) consumer(t *testing.T, atomic bool) (*engine.Engine, *engine.Operation) {
	t.Helper()
	e, err := engine.New(r.st, engine.WithSingleTenant(), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	op, err := e.Operation(engine.OperationSpec{Name: method, Atomic: atomic, OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	return e, op
}

// serveBatch serves a batch of charges together, as a consumer serves its
// messages: message i of tenants[i], its key "m" i suffix.
func serveBatch(e *engine.Engine, op *engine.Operation, tenants []string, suffix string) []*ownCharge {
	cs := make([]*ownCharge, len(tenants))
	xs := make([]engine.Exchange, len(tenants))
	for i, tenant := range tenants {
		cs[i] = &ownCharge{charge: charge{key: fmt.Sprint("m", i, suffix)}, tenant: tenant}
		xs[i] = cs[i]
	}
	e.ServeBatch(context.Background(), op, xs)
	return cs
}

// TestAtomicServeBatch: a batch of messages of tenants on three shards,
// served together in atomic mode as a consumer serves them, commits each
// charge with its record on its tenant's shard; its redelivery replays
// every one, running none again.
func TestAtomicServeBatch(t *testing.T) {
	r := newRig(t, pgshard.WithTenants(map[string]int{"t0": 0, "t1": 1, "t2": 2}))
	e, op := r.consumer(t, true)
	tenants := []string{"t2", "t0", "t1", "t2", "t0"}
	batch := func() []*ownCharge { return serveBatch(e, op, tenants, "") }
	for i, c := range batch() {
		if c.answered.Verdict != engine.Executed || !c.ran {
			t.Errorf("message %d: %v (ran %v), want executed", i, c.answered.Verdict, c.ran)
		}
	}
	for i, c := range batch() {
		if c.answered.Verdict != engine.Replayed || c.ran {
			t.Errorf("message %d redelivered: %v (ran %v), want replayed", i, c.answered.Verdict, c.ran)
		}
	}
	want := []int{2, 1, 2} // t0's two; t1's one; t2's two
	for i := range r.pools {
		if n, m := r.count(t, i, "charges"), r.count(t, i, "idempotency_keys"); n != want[i] || m != want[i] {
			t.Errorf("shard %d holds %d charges and %d records, want %d of each", i, n, m, want[i])
		}
	}
}

// TestShardMetrics: idemkey.shard.duration tells the shards apart: each
// routed call is recorded under its tenant's shard and its operation, a
// call a down shard fails with error.type, and a moving tenant's refusal,
// which reaches no shard, under none.
func TestShardMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	r := newRigWith(t, []*postgres.Store{downStore(t)},
		pgshard.WithTenants(map[string]int{"zero": 0, "two": 2, "down": 3}), pgshard.WithMoving("moving"),
		pgshard.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	e, op := r.engine(t, false)
	for _, k := range []string{"k1", "k2", "k3"} {
		if c := serve(e, op, "zero", &charge{key: k}); c.answered.Verdict != engine.Executed {
			t.Fatalf("zero %s: %v, want executed", k, c.answered.Verdict)
		}
	}
	if c := serve(e, op, "two", &charge{key: "k1"}); c.answered.Verdict != engine.Executed {
		t.Fatalf("two: %v, want executed", c.answered.Verdict)
	}
	for _, tenant := range []string{"down", "moving"} {
		if c := serve(e, op, tenant, &charge{key: "k1"}); c.answered.Verdict != engine.StoreUnavailable || c.ran {
			t.Fatalf("%s: %v (ran %v), want store unavailable", tenant, c.answered.Verdict, c.ran)
		}
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]uint64{} // "shard op error"
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.shard.duration" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				shard, _ := dp.Attributes.Value("idemkey.shard")
				opName, _ := dp.Attributes.Value("idemkey.store.operation")
				failed, _ := dp.Attributes.Value("error.type")
				got[fmt.Sprint(shard.AsInt64(), " ", opName.AsString(), " ", failed.AsString())] += dp.Count
			}
		}
	}
	want := map[string]uint64{
		"0 reserve ": 3, "0 complete ": 3,
		"2 reserve ": 1, "2 complete ": 1,
		"3 reserve store_failed": 1,
	}
	if !maps.Equal(got, want) {
		t.Errorf("idemkey.shard.duration counts by shard, operation and error: %v, want %v", got, want)
	}
}
