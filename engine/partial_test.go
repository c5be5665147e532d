package engine

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// The batch stores here refuse the calls of one tenant, "troubled", as
// store/pgshard refuses those of a tenant being moved or of a shard that is
// down: with a store.PartialError naming them, the others decided.

const troubled = "troubled"

// partialOutcome is the error of a batch call of the partial stores: a
// PartialError of err for each reservation of the troubled tenant, or
// misfit's for every batch with some; nil if the batch has none.
func partialOutcome(rs []store.Reservation, err error, misfit bool) ([]bool, error) {
	failed := make([]bool, len(rs))
	some := false
	for i, r := range rs {
		failed[i] = r.Partition == store.TenantPartition(troubled)
		some = some || failed[i]
	}
	switch {
	case !some:
		return failed, nil
	case misfit: // a store's mistake: Failed does not fit the batch
		return failed, &store.PartialError{Err: err, Failed: failed[1:]}
	}
	return failed, &store.PartialError{Err: err, Failed: failed}
}

// partialMemory is a memory store whose ReserveBatch reserves each call
// but the troubled tenant's, which fail with err.
type partialMemory struct {
	*memory.Store
	err    error
	misfit bool
}

func (s partialMemory) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	failed, err := partialOutcome(rs, s.err, s.misfit)
	res := make([]store.Entry, len(rs))
	for i, r := range rs {
		if failed[i] {
			continue
		}
		var rerr error
		if res[i], rerr = s.Store.Reserve(ctx, r); rerr != nil {
			return nil, rerr
		}
	}
	return res, err
}

// partialFake is the fake atomic store with a BeginBatch that begins each
// call but the troubled tenant's, which fail with err: its BatchTx holds
// the others' transactions, and fails the test if the engine starts,
// records or releases a failed call.
type partialFake struct {
	*fakeStore
	t      *testing.T
	err    error
	misfit bool
}

func (s partialFake) BeginBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, store.BatchTx, error) {
	failed, err := partialOutcome(rs, s.err, s.misfit)
	res := make([]store.Entry, len(rs))
	tx := &partialTx{t: s.t, failed: failed, txs: make([]store.Tx, len(rs)), staged: make([]*staged, len(rs))}
	open := false
	for i, r := range rs {
		if failed[i] {
			continue
		}
		var berr error
		if res[i], tx.txs[i], berr = s.Begin(ctx, r); berr != nil {
			tx.Rollback(ctx)
			return nil, nil, berr
		}
		open = open || tx.txs[i] != nil
	}
	if !open {
		return res, nil, err
	}
	return res, tx, err
}

// partialTx is a batch's transaction over one fake transaction per call.
type partialTx struct {
	t      *testing.T
	mu     sync.Mutex
	failed []bool
	txs    []store.Tx // nil for a call that failed or acquired nothing
	staged []*staged
}

type staged struct {
	outcome    []byte
	keepWrites bool
}

// held is call i's transaction; a call that failed is the engine's mistake.
func (tx *partialTx) held(method string, i int) (store.Tx, error) {
	if tx.failed[i] {
		tx.t.Errorf("%s of call %d, whose reservation failed", method, i)
		return nil, errors.New("partial tx: the call failed")
	}
	if tx.txs[i] == nil {
		tx.t.Errorf("%s of call %d, which holds no key", method, i)
		return nil, errors.New("partial tx: the call holds no key")
	}
	return tx.txs[i], nil
}

func (tx *partialTx) HandlerContext(ctx context.Context, i int) context.Context {
	t, err := tx.held("HandlerContext", i)
	if err != nil {
		return ctx
	}
	return t.HandlerContext(ctx)
}

func (tx *partialTx) Record(_ context.Context, i int, outcome []byte, keepWrites bool) error {
	if _, err := tx.held("Record", i); err != nil {
		return err
	}
	tx.mu.Lock()
	defer tx.mu.Unlock()
	tx.staged[i] = &staged{outcome, keepWrites}
	return nil
}

func (tx *partialTx) Release(ctx context.Context, i int) error {
	t, err := tx.held("Release", i)
	if err != nil {
		return err
	}
	tx.txs[i] = nil
	return t.Rollback(ctx)
}

func (tx *partialTx) Commit(ctx context.Context) error {
	var errs []error
	for i, t := range tx.txs {
		switch {
		case t == nil:
		case tx.staged[i] != nil:
			errs = append(errs, t.Commit(ctx, tx.staged[i].outcome, tx.staged[i].keepWrites))
		default:
			errs = append(errs, t.Rollback(ctx))
		}
	}
	clear(tx.txs)
	return errors.Join(errs...)
}

func (tx *partialTx) Rollback(ctx context.Context) error {
	var errs []error
	for i, t := range tx.txs {
		if t != nil {
			errs = append(errs, t.Rollback(ctx))
			tx.txs[i] = nil
		}
	}
	return errors.Join(errs...)
}

func (tx *partialTx) Err() error { return nil }

// TestServeBatchPartial: a batch whose store fails the calls of one tenant
// alone (store.PartialError) answers those as a store failure is answered
// (store_unavailable, or store_full for store.ErrFull), runs nothing of
// them and records nothing of them, in both modes; the other tenant's calls
// of the batch run, are recorded (in atomic mode with their writes), and
// are told to the hooks and counted as executed; redelivered, they replay
// and the troubled one is refused again. A partial error that does not fit
// the batch fails every call of it, as a plain error does.
func TestServeBatchPartial(t *testing.T) {
	for _, tc := range []struct {
		name   string
		err    error
		misfit bool
		want   Verdict // of the troubled call
	}{
		{"unavailable", fmt.Errorf("shard 3: %w", store.ErrUnavailable), false, StoreUnavailable},
		{"full", fmt.Errorf("shard 3: %w", store.ErrFull), false, StoreFull},
		{"misfit", store.ErrUnavailable, true, StoreUnavailable},
	} {
		for _, atomic := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/atomic=%v", tc.name, atomic), func(t *testing.T) {
				testServeBatchPartial(t, atomic, tc.err, tc.misfit, tc.want)
			})
		}
	}
}

func testServeBatchPartial(t *testing.T, atomic bool, storeErr error, misfit bool, want Verdict) {
	var (
		st    store.Store
		fake  *fakeStore
		mem   *memory.Store
		mu    sync.Mutex
		heard []string // each hook's call, "hook tenant key verdict recorded"
	)
	if atomic {
		fake = newFakeStore()
		st = partialFake{fakeStore: fake, t: t, err: storeErr, misfit: misfit}
	} else {
		mem = memory.New()
		st = partialMemory{Store: mem, err: storeErr, misfit: misfit}
	}
	hook := func(name string) func(context.Context, Event) {
		return func(_ context.Context, ev Event) {
			mu.Lock()
			defer mu.Unlock()
			heard = append(heard, fmt.Sprint(name, " ", ev.Tenant, " ", ev.Key, " ", ev.Verdict, " ", ev.Recorded))
		}
	}
	reader := sdkmetric.NewManualReader()
	e := mustEngine(t, st, WithLogger(nil), WithHooks(Hooks{OnExecute: hook("execute"), OnReplay: hook("replay"), OnRefuse: hook("refuse")}),
		WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))
	op, err := e.Operation(OperationSpec{Name: opName, Atomic: atomic, OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	tenants := []string{"healthy", troubled, "healthy"}
	batch := func() []*ownTenantCall {
		xs := make([]*ownTenantCall, len(tenants))
		exs := make([]Exchange, len(tenants))
		for i, tenant := range tenants {
			key := fmt.Sprint("m", i)
			xs[i] = &ownTenantCall{stepCall: stepCall{key: key, request: "r", run: func(ctx context.Context) error {
				if atomic && !write(ctx, key) {
					t.Errorf("call %d: the handler's context carries no transaction", i)
				}
				return nil
			}}, tenant: tenant}
			exs[i] = xs[i]
		}
		e.ServeBatch(context.Background(), op, exs)
		return xs
	}
	recorded := func(i int) bool {
		key := store.ScopeKey(tenants[i], opName, fmt.Sprint("m", i))
		if atomic {
			_, ok := fake.outcome(key)
			return ok
		}
		res, _, ok, err := mem.Lookup(context.Background(), key)
		if err != nil {
			t.Fatal(err)
		}
		return ok && res.State == store.Completed
	}

	first := batch()
	for i, x := range first {
		good := tenants[i] != troubled && !misfit
		switch {
		case !good && tenants[i] == troubled && (x.ran || x.answer.Verdict != want):
			t.Errorf("the troubled call: ran %v, answered %v; want %v, not run", x.ran, x.answer.Verdict, want)
		case !good && tenants[i] != troubled && (x.ran || x.answer.Verdict != StoreUnavailable):
			t.Errorf("call %d of a batch whose partial error does not fit it: ran %v, answered %v; want store_unavailable, not run", i, x.ran, x.answer.Verdict)
		case good && (!x.ran || x.answer.Verdict != Executed):
			t.Errorf("call %d of the healthy tenant: ran %v, answered %v; want executed", i, x.ran, x.answer.Verdict)
		}
		if recorded(i) != good {
			t.Errorf("call %d: recorded %v, want %v", i, !good, good)
		}
	}
	if atomic {
		wantWrites := []string{"m0", "m2"}
		if misfit {
			wantWrites = nil
		}
		if got := fake.committedWrites(); !slices.Equal(got, wantWrites) {
			t.Errorf("committed writes %q, want %q", got, wantWrites)
		}
	}
	if misfit {
		return
	}
	if want == StoreFull && first[1].answer.RetryAfter <= 0 {
		t.Errorf("the troubled call answered store_full with no retry delay")
	}
	again := batch()
	for i, x := range again {
		wantAgain := Replayed
		if tenants[i] == troubled {
			wantAgain = want
		}
		if x.ran || x.answer.Verdict != wantAgain {
			t.Errorf("call %d redelivered: ran %v, answered %v; want %v, not run", i, x.ran, x.answer.Verdict, wantAgain)
		}
	}

	wantHeard := []string{
		"execute healthy m0 executed true", "refuse troubled m1 " + want.String() + " false", "execute healthy m2 executed true",
		"replay healthy m0 replayed false", "refuse troubled m1 " + want.String() + " false", "replay healthy m2 replayed false",
	}
	if !slices.Equal(heard, wantHeard) {
		t.Errorf("the hooks heard:\n%s\nwant:\n%s", strings.Join(heard, "\n"), strings.Join(wantHeard, "\n"))
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	counted := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.calls" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				v, _ := dp.Attributes.Value("idemkey.outcome")
				counted[v.AsString()] += dp.Value
			}
		}
	}
	if wantCounted := map[string]int64{"executed": 2, "replayed": 2, want.String(): 2}; !maps.Equal(counted, wantCounted) {
		t.Errorf("idemkey.calls by outcome: %v, want %v", counted, wantCounted)
	}
}

// TestServeBatchPartialMisfitFreesKeys: a two-phase batch whose store
// answers a store.PartialError that does not fit it fails every call, so
// the keys the store says it took for the healthy tenant are released, not
// left held for a lease: their redelivery runs them at once.
func TestServeBatchPartialMisfitFreesKeys(t *testing.T) {
	mem := memory.New()
	e := mustEngine(t, partialMemory{Store: mem, err: store.ErrUnavailable, misfit: true}, WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName, OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	tenants := []string{"healthy", troubled, "healthy"}
	xs := make([]*ownTenantCall, len(tenants))
	exs := make([]Exchange, len(tenants))
	for i, tenant := range tenants {
		xs[i] = &ownTenantCall{stepCall: stepCall{key: fmt.Sprint("m", i), request: "r", run: func(context.Context) error { return nil }}, tenant: tenant}
		exs[i] = xs[i]
	}
	e.ServeBatch(context.Background(), op, exs)
	for i, x := range xs {
		if x.ran || x.answer.Verdict != StoreUnavailable {
			t.Fatalf("call %d of the misfit batch: ran %v, answered %v; want store_unavailable, not run", i, x.ran, x.answer.Verdict)
		}
	}
	for _, i := range []int{0, 2} {
		again := &ownTenantCall{stepCall: stepCall{key: fmt.Sprint("m", i), request: "r", run: func(context.Context) error { return nil }}, tenant: "healthy", retried: true}
		e.Serve(context.Background(), op, again)
		if !again.ran || again.answer.Verdict != Executed {
			t.Errorf("call %d redelivered alone: ran %v, answered %v; want executed (its key free)", i, again.ran, again.answer.Verdict)
		}
	}
}
