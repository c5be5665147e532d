// Package storetest is the conformance suite for store.Store, and for
// store.Finder, store.Sweeper, store.BatchReserver, store.Watcher,
// store.Stepper, store.Renewer and store.Looker where a store implements
// them. Expiry is checked through Reserve and Find for every store;
// sweeping only for a Sweeper. Each call's context carries its tenant's
// partition, as the engine's do. Every store runs it from its own tests:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) storetest.Harness { ... })
//	}
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Harness is one fresh, empty store under test.
type Harness struct {
	Store store.Store
	// Advance moves time forward by d as the store sees it, for leases and
	// expiry alike, without sleeping. A store on a server's clock takes a
	// test-only offset to it (store/redis).
	Advance func(t *testing.T, d time.Duration)
	// ShiftsRecords is true when Advance moves every record back by d
	// rather than the store's clock forward (store/postgres): an expiry
	// the store told before then moves back by d too.
	ShiftsRecords bool
}

const (
	lease     = 10 * time.Second
	retention = time.Hour
	// maxOutcome is what each reservation says its outcome may take, as the
	// engine's do; testReplay records one of that size.
	maxOutcome = 64 << 10
	tenant     = "tenant"
)

var (
	fpA = store.Fingerprint{1}
	fpB = store.Fingerprint{2}
)

// Run runs the suite; open is called once per subtest for a fresh store.
func Run(t *testing.T, open func(t *testing.T) Harness) {
	t.Helper()
	for _, tc := range []struct {
		name string
		test func(t *testing.T, h Harness)
	}{
		{"Acquire", testAcquire},
		{"Replay", testReplay},
		{"InProgress", testInProgress},
		{"LeaseTakeover", testLeaseTakeover},
		{"NoTakeoverForOtherRequest", testNoTakeoverForOtherRequest},
		{"StaleToken", testStaleToken},
		{"Release", testRelease},
		{"CompleteOnce", testCompleteOnce},
		{"ExpiredTakeover", testExpiredTakeover},
		{"ExpiredHolder", testExpiredHolder},
		{"Expiry", testExpiry},
		{"Sweep", testSweep},
		{"SweepBatches", testSweepBatches},
		{"KeysIndependent", testKeysIndependent},
		{"ConcurrentReserve", testConcurrentReserve},
		{"Find", testFind},
		{"Expires", testExpires},
		{"ReserveBatch", testReserveBatch},
		{"ConcurrentReserveBatch", testConcurrentReserveBatch},
		{"Watch", testWatch},
		{"Steps", testSteps},
		{"StepsOtherRequest", testStepsOtherRequest},
		{"StepsFenced", testStepsFenced},
		{"FinishUnstarted", testFinishUnstarted},
		{"ForgetSteps", testForgetSteps},
		{"StepsExpire", testStepsExpire},
		{"StepsAtomic", testStepsAtomic},
		{"ConcurrentStartStep", testConcurrentStartStep},
		{"Renew", testRenew},
		{"Lookup", testLookup},
		{"LookupLeaseEnded", testLookupLeaseEnded},
		{"LookupSteps", testLookupSteps},
		{"LookupAtomic", testLookupAtomic},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.test(t, open(t))
		})
	}
}

// tenantContext is the context of the suite's store calls: with its
// tenant's partition, as the engine gives each call
// (store.ContextWithPartition).
func tenantContext() context.Context {
	return store.ContextWithPartition(context.Background(), store.TenantPartition(tenant))
}

func newKey(t *testing.T, name string) store.Key {
	return store.ScopeKey(tenant, "/storetest.v1.Service/Method", t.Name()+"/"+name)
}

func reserve(t *testing.T, st store.Store, key store.Key, fp store.Fingerprint) store.Entry {
	t.Helper()
	return reserveFor(t, st, key, fp, lease, retention)
}

func reserveFor(t *testing.T, st store.Store, key store.Key, fp store.Fingerprint, lease, retention time.Duration) store.Entry {
	t.Helper()
	res, err := st.Reserve(tenantContext(), reservation(key, fp, lease, retention))
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	return res
}

// reservation asks for key as the engine does: with the largest outcome the
// call may record and the tenant's partition.
func reservation(key store.Key, fp store.Fingerprint, lease, retention time.Duration) store.Reservation {
	return store.Reservation{Key: key, Fingerprint: fp, Lease: lease, Retention: retention, MaxOutcome: maxOutcome, Partition: store.TenantPartition(tenant)}
}

func mustAcquire(t *testing.T, st store.Store, key store.Key, fp store.Fingerprint) store.Token {
	t.Helper()
	res := reserve(t, st, key, fp)
	if res.State != store.Acquired {
		t.Fatalf("Reserve state = %v, want acquired", res.State)
	}
	return res.Token
}

func complete(t *testing.T, st store.Store, key store.Key, token store.Token, outcome []byte) {
	t.Helper()
	if err := st.Complete(tenantContext(), key, token, outcome); err != nil {
		t.Fatalf("Complete: %v", err)
	}
}

func wantState(t *testing.T, res store.Entry, want store.State) {
	t.Helper()
	if res.State != want {
		t.Fatalf("Reserve state = %v, want %v", res.State, want)
	}
}

func wantLeaseLost(t *testing.T, op string, err error) {
	t.Helper()
	if !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("%s with a token that does not hold the key: err = %v, want ErrLeaseLost", op, err)
	}
}

func testAcquire(t *testing.T, h Harness) {
	res := reserve(t, h.Store, newKey(t, "k"), fpA)
	wantState(t, res, store.Acquired)
	if res.Token == 0 {
		t.Error("acquired with token 0")
	}
}

func testReplay(t *testing.T, h Harness) {
	key := newKey(t, "k")
	outcome := make([]byte, maxOutcome)
	rand.Read(outcome)
	complete(t, h.Store, key, mustAcquire(t, h.Store, key, fpA), outcome)

	for _, fp := range []store.Fingerprint{fpA, fpB} {
		res := reserve(t, h.Store, key, fp)
		wantState(t, res, store.Completed)
		if res.Fingerprint != fpA {
			t.Errorf("replay fingerprint = %x, want the first request's %x", res.Fingerprint[:4], fpA[:4])
		}
		if !bytes.Equal(res.Outcome, outcome) {
			t.Errorf("replayed outcome differs from the recorded one (%d bytes, want %d)", len(res.Outcome), len(outcome))
		}
	}

	empty := newKey(t, "empty")
	complete(t, h.Store, empty, mustAcquire(t, h.Store, empty, fpA), nil)
	if res := reserve(t, h.Store, empty, fpA); res.State != store.Completed || len(res.Outcome) != 0 {
		t.Errorf("empty outcome: state %v with %d bytes, want completed with 0", res.State, len(res.Outcome))
	}
}

func testInProgress(t *testing.T, h Harness) {
	key := newKey(t, "k")
	mustAcquire(t, h.Store, key, fpA)
	for _, fp := range []store.Fingerprint{fpA, fpB} {
		res := reserve(t, h.Store, key, fp)
		wantState(t, res, store.Held)
		if res.Fingerprint != fpA {
			t.Errorf("in-progress fingerprint = %x, want %x", res.Fingerprint[:4], fpA[:4])
		}
		if res.RetryAfter <= 0 || res.RetryAfter > lease {
			t.Errorf("RetryAfter = %v, want in (0, %v]", res.RetryAfter, lease)
		}
	}
}

func testLeaseTakeover(t *testing.T, h Harness) {
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	h.Advance(t, lease+time.Second)

	second := mustAcquire(t, h.Store, key, fpA)
	if second == first {
		t.Fatalf("takeover kept token %d; want a new one", first)
	}
	wantState(t, reserve(t, h.Store, key, fpA), store.Held)
	wantLeaseLost(t, "Complete", h.Store.Complete(tenantContext(), key, first, []byte("stale")))
	complete(t, h.Store, key, second, []byte("fresh"))
	if res := reserve(t, h.Store, key, fpA); string(res.Outcome) != "fresh" {
		t.Errorf("outcome = %q, want the one recorded by the new holder", res.Outcome)
	}
}

func testNoTakeoverForOtherRequest(t *testing.T, h Harness) {
	key := newKey(t, "k")
	mustAcquire(t, h.Store, key, fpA)
	h.Advance(t, lease+time.Second)

	res := reserve(t, h.Store, key, fpB)
	wantState(t, res, store.Held)
	if res.Fingerprint != fpA {
		t.Errorf("fingerprint = %x, want the first request's %x", res.Fingerprint[:4], fpA[:4])
	}
	mustAcquire(t, h.Store, key, fpA)
}

func testStaleToken(t *testing.T, h Harness) {
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	wantLeaseLost(t, "Complete", h.Store.Complete(tenantContext(), key, token+1, []byte("x")))
	wantLeaseLost(t, "Release", h.Store.Release(tenantContext(), key, token+1))
	wantLeaseLost(t, "Complete", h.Store.Complete(tenantContext(), newKey(t, "absent"), token, []byte("x")))
	wantState(t, reserve(t, h.Store, key, fpA), store.Held)
}

func testRelease(t *testing.T, h Harness) {
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	if err := h.Store.Release(tenantContext(), key, first); err != nil {
		t.Fatalf("Release: %v", err)
	}
	wantLeaseLost(t, "Complete after Release", h.Store.Complete(tenantContext(), key, first, []byte("x")))
	wantLeaseLost(t, "Release twice", h.Store.Release(tenantContext(), key, first))

	// A released key is free for any request, even a different one.
	if second := mustAcquire(t, h.Store, key, fpB); second == first {
		t.Errorf("reacquired with the released token %d; tokens must not repeat", first)
	}
}

func testCompleteOnce(t *testing.T, h Harness) {
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	complete(t, h.Store, key, token, []byte("first"))
	wantLeaseLost(t, "Complete twice", h.Store.Complete(tenantContext(), key, token, []byte("second")))
	wantLeaseLost(t, "Release after Complete", h.Store.Release(tenantContext(), key, token))
	if res := reserve(t, h.Store, key, fpA); string(res.Outcome) != "first" {
		t.Errorf("outcome = %q, want %q", res.Outcome, "first")
	}
}

func testExpiredTakeover(t *testing.T, h Harness) {
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	complete(t, h.Store, key, first, []byte("old"))
	h.Advance(t, retention+time.Second)

	// After retention the key is new, whatever request comes with it.
	second := mustAcquire(t, h.Store, key, fpB)
	if second == first {
		t.Errorf("expired takeover kept token %d", first)
	}
	wantState(t, reserve(t, h.Store, key, fpB), store.Held)
}

// A holder whose lease and retention have both passed holds nothing: the
// record counts as absent, so its outcome cannot be recorded.
func testExpiredHolder(t *testing.T, h Harness) {
	key, other := newKey(t, "k"), newKey(t, "other")
	token := reserveFor(t, h.Store, key, fpA, lease, lease/2).Token
	otherToken := reserveFor(t, h.Store, other, fpA, lease, lease/2).Token
	h.Advance(t, lease+time.Second)
	wantLeaseLost(t, "Complete after expiry", h.Store.Complete(tenantContext(), key, token, []byte("late")))
	wantLeaseLost(t, "Release after expiry", h.Store.Release(tenantContext(), other, otherToken))
	wantState(t, reserve(t, h.Store, key, fpB), store.Acquired)
}

// testExpiry checks, through Reserve, which records count as absent once time
// has passed: those whose retention has passed and whose lease has ended,
// completed or not, and no others.
func testExpiry(t *testing.T, h Harness) {
	// Times are seconds from the start; lease is 10s.
	doneOld, deadOld, liveOld := newKey(t, "done-old"), newKey(t, "dead-old"), newKey(t, "live-old")
	doneNew, liveNew := newKey(t, "done-new"), newKey(t, "live-new")
	// At 0: two records expiring at 60, one completed, one whose lease ends at 10.
	complete(t, h.Store, doneOld, reserveFor(t, h.Store, doneOld, fpA, lease, time.Minute).Token, []byte("x"))
	reserveFor(t, h.Store, deadOld, fpA, lease, time.Minute)
	h.Advance(t, 55*time.Second)
	// At 55: one expiring at 56 whose lease runs to 65, and two that live long.
	reserveFor(t, h.Store, liveOld, fpA, lease, time.Second)
	complete(t, h.Store, doneNew, mustAcquire(t, h.Store, doneNew, fpA), []byte("y"))
	mustAcquire(t, h.Store, liveNew, fpA)
	h.Advance(t, 7*time.Second)

	// At 62: done-old and dead-old are gone, so another request acquires them.
	wantState(t, reserve(t, h.Store, doneOld, fpB), store.Acquired)
	wantState(t, reserve(t, h.Store, deadOld, fpB), store.Acquired)
	wantState(t, reserve(t, h.Store, liveOld, fpB), store.Held)
	wantState(t, reserve(t, h.Store, doneNew, fpB), store.Completed)
	wantState(t, reserve(t, h.Store, liveNew, fpB), store.Held)
}

func testSweep(t *testing.T, h Harness) {
	sweeper := need[store.Sweeper](t, h)
	// Times are seconds from the start; lease is 10s.
	ctx := tenantContext()
	doneOld, deadOld, liveOld := newKey(t, "done-old"), newKey(t, "dead-old"), newKey(t, "live-old")
	doneNew, liveNew := newKey(t, "done-new"), newKey(t, "live-new")
	// At 0: two records expiring at 60, one completed, one whose lease ends at 10.
	complete(t, h.Store, doneOld, reserveFor(t, h.Store, doneOld, fpA, lease, time.Minute).Token, []byte("x"))
	reserveFor(t, h.Store, deadOld, fpA, lease, time.Minute)
	h.Advance(t, 55*time.Second)
	// At 55: one expiring at 56 whose lease runs to 65, and two that live long.
	reserveFor(t, h.Store, liveOld, fpA, lease, time.Second)
	complete(t, h.Store, doneNew, mustAcquire(t, h.Store, doneNew, fpA), []byte("y"))
	mustAcquire(t, h.Store, liveNew, fpA)
	h.Advance(t, 7*time.Second)

	// At 62: only done-old and dead-old are expired.
	deleted, err := sweeper.Sweep(ctx, 100)
	if err != nil {
		t.Fatalf("Sweep: %v", err)
	}
	if deleted != 2 {
		t.Errorf("Sweep deleted %d records, want 2 (the expired completed one and the expired one whose lease ended)", deleted)
	}
	wantState(t, reserve(t, h.Store, liveOld, fpA), store.Held)
	wantState(t, reserve(t, h.Store, doneNew, fpA), store.Completed)
	wantState(t, reserve(t, h.Store, liveNew, fpA), store.Held)
	if deleted, err := sweeper.Sweep(ctx, 100); err != nil || deleted != 0 {
		t.Errorf("second Sweep = %d, %v; want 0, nil", deleted, err)
	}
}

func testSweepBatches(t *testing.T, h Harness) {
	sweeper := need[store.Sweeper](t, h)
	for i := range 7 {
		key := newKey(t, string(rune('a'+i)))
		complete(t, h.Store, key, mustAcquire(t, h.Store, key, fpA), nil)
	}
	h.Advance(t, retention+time.Second)
	deleted, err := sweeper.Sweep(tenantContext(), 2)
	if err != nil || deleted != 7 {
		t.Errorf("Sweep in batches of 2 = %d, %v; want 7, nil", deleted, err)
	}
}

// need returns h's store as the optional interface T, or skips the test
// of a store that does not implement it (a store that expires records by
// itself needs no store.Sweeper).
func need[T any](t *testing.T, h Harness) T {
	t.Helper()
	v, ok := h.Store.(T)
	if !ok {
		t.Skipf("%T does not implement %v", h.Store, reflect.TypeFor[T]())
	}
	return v
}

func testKeysIndependent(t *testing.T, h Harness) {
	a, b := newKey(t, "a"), newKey(t, "b")
	complete(t, h.Store, a, mustAcquire(t, h.Store, a, fpA), []byte("a"))
	tokenB := mustAcquire(t, h.Store, b, fpA)
	wantLeaseLost(t, "Complete of another key's token", h.Store.Complete(tenantContext(), a, tokenB, []byte("b")))
	if res := reserve(t, h.Store, a, fpA); string(res.Outcome) != "a" {
		t.Errorf("outcome of a = %q, want %q", res.Outcome, "a")
	}
}

func testConcurrentReserve(t *testing.T, h Harness) {
	const callers = 50
	key := newKey(t, "k")
	var (
		wg     sync.WaitGroup
		start  = make(chan struct{})
		states = make(chan store.State, callers)
		errs   = make(chan error, callers)
	)
	for range callers {
		wg.Go(func() {
			<-start
			res, err := h.Store.Reserve(tenantContext(), reservation(key, fpA, lease, retention))
			if err != nil {
				errs <- err
				return
			}
			states <- res.State
		})
	}
	close(start)
	wg.Wait()
	close(states)
	close(errs)
	for err := range errs {
		t.Errorf("Reserve: %v", err)
	}
	count := map[store.State]int{}
	for s := range states {
		count[s]++
	}
	if count[store.Acquired] != 1 || count[store.Held] != callers-1 {
		t.Errorf("%d concurrent reserves gave %v; want exactly one acquired and the rest in progress", callers, count)
	}
}

// testFind checks that Find answers exactly what Reserve would for a
// completed record, and nothing for any other.
func testFind(t *testing.T, h Harness) {
	finder := need[store.Finder](t, h)
	find := func(key store.Key) (store.Entry, bool) {
		t.Helper()
		res, found, err := finder.Find(tenantContext(), key)
		if err != nil {
			t.Fatalf("Find: %v", err)
		}
		return res, found
	}
	done, running, released := newKey(t, "done"), newKey(t, "running"), newKey(t, "released")
	complete(t, h.Store, done, mustAcquire(t, h.Store, done, fpA), []byte("reply"))
	mustAcquire(t, h.Store, running, fpA)
	if err := h.Store.Release(tenantContext(), released, mustAcquire(t, h.Store, released, fpA)); err != nil {
		t.Fatalf("Release: %v", err)
	}

	res, found := find(done)
	if !found || res.State != store.Completed || res.Fingerprint != fpA || string(res.Outcome) != "reply" {
		t.Errorf("Find of a completed record = %v, %v, %x, %q; want completed, found, %x, %q",
			res.State, found, res.Fingerprint[:4], res.Outcome, fpA[:4], "reply")
	}
	for name, key := range map[string]store.Key{"an unknown key": newKey(t, "unknown"), "a record in progress": running, "a released record": released} {
		if _, found := find(key); found {
			t.Errorf("Find of %s found a record", name)
		}
	}
	h.Advance(t, retention+time.Second)
	if _, found := find(done); found {
		t.Error("Find of an expired record found it")
	}
}

// testExpires checks that every answer about one record tells the same
// expiry, its creation plus its retention: the instant every transport
// tells the client.
func testExpires(t *testing.T, h Harness) {
	key := newKey(t, "k")
	first := reserve(t, h.Store, key, fpA)
	wantState(t, first, store.Acquired)
	exp := first.Expires
	if exp.IsZero() {
		t.Fatal("Acquired: Expires is zero")
	}
	advance := func(d time.Duration) {
		h.Advance(t, d)
		if h.ShiftsRecords {
			exp = exp.Add(-d)
		}
	}
	same := func(what string, res store.Entry) {
		t.Helper()
		if !res.Expires.Equal(exp) {
			t.Errorf("%s: Expires = %v, want %v as Acquired told", what, res.Expires, exp)
		}
	}
	same("in progress, same request", reserve(t, h.Store, key, fpA))
	same("in progress, another request", reserve(t, h.Store, key, fpB))
	advance(lease + time.Second) // the lease ends: a retry takes the key over
	takeover := reserve(t, h.Store, key, fpA)
	wantState(t, takeover, store.Acquired)
	same("taken over", takeover)
	complete(t, h.Store, key, takeover.Token, []byte("reply"))
	advance(retention / 2)
	same("completed", reserve(t, h.Store, key, fpB))
	if finder, ok := h.Store.(store.Finder); ok {
		res, found, err := finder.Find(tenantContext(), key)
		if err != nil || !found {
			t.Fatalf("Find = %v, %v; want the completed record", found, err)
		}
		same("Find", res)
	}
	// Another key created later expires later by as much: its creation
	// plus the retention. (The store's clock is not this test's, so only
	// the difference is checked, with room for the time the test takes.)
	later := reserve(t, h.Store, newKey(t, "later"), fpA)
	if d := later.Expires.Sub(exp); d < lease+retention/2 || d > lease+retention/2+time.Minute {
		t.Errorf("a key created %v later expires %v later", lease+retention/2, d)
	}
}

// testReserveBatch checks that ReserveBatch decides each key of a batch
// as Reserve decides one, whatever state its record is in, and that what
// it acquired is held as Reserve's is.
func testReserveBatch(t *testing.T, h Harness) {
	br := need[store.BatchReserver](t, h)
	ctx := tenantContext()
	keys := map[string]store.Key{}
	for _, name := range []string{"new", "done", "running", "dead", "dead-other", "old", "released"} {
		keys[name] = newKey(t, name)
	}
	complete(t, h.Store, keys["done"], mustAcquire(t, h.Store, keys["done"], fpA), []byte("reply"))
	complete(t, h.Store, keys["old"], reserveFor(t, h.Store, keys["old"], fpA, lease, lease/2).Token, []byte("old"))
	mustAcquire(t, h.Store, keys["dead"], fpA)
	mustAcquire(t, h.Store, keys["dead-other"], fpA)
	if err := h.Store.Release(ctx, keys["released"], mustAcquire(t, h.Store, keys["released"], fpA)); err != nil {
		t.Fatalf("Release: %v", err)
	}
	h.Advance(t, lease+time.Second) // the leases of dead and dead-other end; old expires
	mustAcquire(t, h.Store, keys["running"], fpA)

	cases := []struct {
		name  string
		fp    store.Fingerprint
		state store.State
	}{
		{"new", fpA, store.Acquired},
		{"done", fpB, store.Completed}, // the caller tells a reused key by the fingerprint
		{"running", fpA, store.Held},
		{"dead", fpA, store.Acquired}, // taken over by the same request
		{"dead-other", fpB, store.Held},
		{"old", fpB, store.Acquired},
		{"released", fpB, store.Acquired},
	}
	rs := make([]store.Reservation, len(cases))
	for i, c := range cases {
		rs[i] = reservation(keys[c.name], c.fp, lease, retention)
	}
	res, err := br.ReserveBatch(ctx, rs)
	if err != nil {
		t.Fatalf("ReserveBatch: %v", err)
	}
	if len(res) != len(rs) {
		t.Fatalf("ReserveBatch answered %d results for %d reservations", len(res), len(rs))
	}
	tokens := map[store.Token]bool{}
	for i, c := range cases {
		r := res[i]
		if r.State != c.state {
			t.Errorf("%s: state = %v, want %v", c.name, r.State, c.state)
			continue
		}
		if r.Expires.IsZero() {
			t.Errorf("%s: Expires is zero", c.name)
		}
		switch r.State {
		case store.Acquired:
			if r.Token == 0 || tokens[r.Token] {
				t.Errorf("%s: token %d is zero or another key's", c.name, r.Token)
			}
			tokens[r.Token] = true
		case store.Completed:
			if r.Fingerprint != fpA || string(r.Outcome) != "reply" {
				t.Errorf("%s: fingerprint %x, outcome %q; want %x, %q", c.name, r.Fingerprint[:4], r.Outcome, fpA[:4], "reply")
			}
		case store.Held:
			if r.Fingerprint != fpA || (c.name == "running" && r.RetryAfter <= 0) {
				t.Errorf("%s: fingerprint %x, retry after %v; want %x (and the lease left, if live)", c.name, r.Fingerprint[:4], r.RetryAfter, fpA[:4])
			}
		}
	}
	// What the batch acquired is held: in progress to anyone else, and
	// recorded or released with its token.
	wantState(t, reserve(t, h.Store, keys["new"], fpA), store.Held)
	complete(t, h.Store, keys["new"], res[0].Token, []byte("batched"))
	if r := reserve(t, h.Store, keys["new"], fpA); r.State != store.Completed || string(r.Outcome) != "batched" {
		t.Errorf("after Complete: %v %q, want the batch's outcome", r.State, r.Outcome)
	}
	if err := h.Store.Release(ctx, keys["released"], res[6].Token); err != nil {
		t.Errorf("Release of a key the batch acquired: %v", err)
	}
	wantState(t, reserve(t, h.Store, keys["released"], fpA), store.Acquired)

	if _, err := br.ReserveBatch(ctx, []store.Reservation{rs[0], rs[0]}); err == nil {
		t.Error("ReserveBatch of one key twice succeeded; want an error")
	}
}

// testConcurrentReserveBatch races batches that share keys, in different
// orders, with each other and with Reserve, round after round: each key is
// acquired exactly once, and no batch fails (two batches that wait for
// each other's inserts must not deadlock).
func testConcurrentReserveBatch(t *testing.T, h Harness) {
	br := need[store.BatchReserver](t, h)
	const (
		rounds  = 10
		nkeys   = 32
		batches = 8
	)
	for round := range rounds {
		keys := make([]store.Key, nkeys)
		for i := range keys {
			keys[i] = newKey(t, fmt.Sprint(round, "/", i))
		}
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			acquired = map[store.Key]int{}
			start    = make(chan struct{})
		)
		note := func(key store.Key, res store.Entry) {
			mu.Lock()
			defer mu.Unlock()
			if res.State == store.Acquired {
				acquired[key]++
			}
		}
		for b := range batches {
			wg.Go(func() {
				rs := make([]store.Reservation, nkeys)
				for i := range rs {
					k := (i + b*nkeys/batches) % nkeys // a different order in each batch
					if b%2 == 1 {
						k = nkeys - 1 - k
					}
					rs[i] = reservation(keys[k], fpA, lease, retention)
				}
				<-start
				res, err := br.ReserveBatch(tenantContext(), rs)
				if err != nil {
					t.Errorf("ReserveBatch: %v", err)
					return
				}
				for i := range rs {
					note(rs[i].Key, res[i])
				}
			})
			wg.Go(func() {
				<-start
				key := keys[b]
				res, err := h.Store.Reserve(tenantContext(), reservation(key, fpA, lease, retention))
				if err != nil {
					t.Errorf("Reserve: %v", err)
					return
				}
				note(key, res)
			})
		}
		close(start)
		wg.Wait()
		for i, key := range keys {
			if acquired[key] != 1 {
				t.Errorf("round %d: key %d was acquired %d times, want once", round, i, acquired[key])
			}
		}
	}
}

// testWatch: a Watch of a key another call holds is told when the key is
// completed or released, and not by another key's change; one of a key no
// call holds (none, completed, or its lease ended) is told at once.
func testWatch(t *testing.T, h Harness) {
	w := need[store.Watcher](t, h)
	ctx := tenantContext()
	wantClosed := func(what string, ch <-chan struct{}) {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(30 * time.Second): // a store that hears of the change later (pub/sub) has ample time
			t.Fatalf("Watch of %s: not told", what)
		}
	}
	wantOpen := func(what string, ch <-chan struct{}) {
		t.Helper()
		select {
		case <-ch:
			t.Fatalf("Watch of %s: told of a change", what)
		default:
		}
	}
	absent, stop := w.Watch(newKey(t, "absent"))
	wantClosed("a key no call holds", absent)
	stop()

	key, other := newKey(t, "k"), newKey(t, "other")
	token, otherToken := mustAcquire(t, h.Store, key, fpA), mustAcquire(t, h.Store, other, fpA)
	first, stopFirst := w.Watch(key)
	_, stopSecond := w.Watch(key)
	wantOpen("a key held", first)
	stopSecond() // the other Watch of the key goes on
	complete(t, h.Store, other, otherToken, []byte("other"))
	wantOpen("a key held, once another key is completed", first)
	complete(t, h.Store, key, token, []byte("done"))
	wantClosed("a key held, once it is completed", first)
	stopFirst()
	done, stop := w.Watch(key)
	wantClosed("a completed key", done)
	stop()

	released := newKey(t, "released")
	token = mustAcquire(t, h.Store, released, fpA)
	ch, stop := w.Watch(released)
	if err := h.Store.Release(ctx, released, token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	wantClosed("a key held, once it is released", ch)
	stop()

	ended := newKey(t, "ended")
	reserveFor(t, h.Store, ended, fpA, time.Second, retention)
	h.Advance(t, 2*time.Second)
	ch, stop = w.Watch(ended)
	wantClosed("a key whose lease ended", ch)
	stop()
}
