package storetest

import (
	"slices"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// The tests of store.Looker, skipped for a store without it.

func lookup(t *testing.T, lk store.Looker, key store.Key) (store.Entry, []string, bool) {
	t.Helper()
	res, steps, ok, err := lk.Lookup(tenantContext(), key)
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	return res, steps, ok
}

// testLookup: Lookup tells a key's record as it goes from in progress to
// completed, and reserves nothing.
func testLookup(t *testing.T, h Harness) {
	lk := need[store.Looker](t, h)
	key := newKey(t, "k")
	if res, steps, ok := lookup(t, lk, key); ok || len(steps) > 0 {
		t.Fatalf("Lookup of an unknown key = %v, steps %q, found; want none", res.State, steps)
	}
	acquired := reserve(t, h.Store, key, fpA)
	wantState(t, acquired, store.Acquired) // Lookup reserved nothing
	res, _, ok := lookup(t, lk, key)
	if !ok || res.State != store.Held || res.Fingerprint != fpA {
		t.Fatalf("Lookup of a key in progress = %v, %x, found %v; want in progress, %x", res.State, res.Fingerprint[:4], ok, fpA[:4])
	}
	if res.RetryAfter <= 0 || res.RetryAfter > lease {
		t.Errorf("Lookup of a key in progress: RetryAfter = %v, want the lease's time left, in (0, %v]", res.RetryAfter, lease)
	}
	if !res.Expires.Equal(acquired.Expires) {
		t.Errorf("Lookup of a key in progress: Expires = %v, want %v as Acquired told", res.Expires, acquired.Expires)
	}
	wantState(t, reserve(t, h.Store, key, fpA), store.Held) // the lease is still the holder's

	complete(t, h.Store, key, acquired.Token, []byte("reply"))
	res, _, ok = lookup(t, lk, key)
	if !ok || res.State != store.Completed || res.Fingerprint != fpA || string(res.Outcome) != "reply" {
		t.Fatalf("Lookup of a completed key = %v, %x, %q, found %v; want completed, %x, %q", res.State, res.Fingerprint[:4], res.Outcome, ok, fpA[:4], "reply")
	}
	if !res.Expires.Equal(acquired.Expires) {
		t.Errorf("Lookup of a completed key: Expires = %v, want %v as Acquired told", res.Expires, acquired.Expires)
	}
	h.Advance(t, retention+time.Second)
	if res, _, ok := lookup(t, lk, key); ok {
		t.Errorf("Lookup of an expired record = %v, found; want none", res.State)
	}
}

// testLookupLeaseEnded: a record whose lease ended before it was completed
// is still in progress, with nothing left to wait; a released one is gone.
func testLookupLeaseEnded(t *testing.T, h Harness) {
	lk := need[store.Looker](t, h)
	key, released := newKey(t, "k"), newKey(t, "released")
	mustAcquire(t, h.Store, key, fpA)
	if err := h.Store.Release(tenantContext(), released, mustAcquire(t, h.Store, released, fpA)); err != nil {
		t.Fatalf("Release: %v", err)
	}
	h.Advance(t, lease+time.Second)
	res, _, ok := lookup(t, lk, key)
	if !ok || res.State != store.Held || res.RetryAfter != 0 {
		t.Errorf("Lookup of a key whose lease ended = %v, retry after %v, found %v; want in progress, 0", res.State, res.RetryAfter, ok)
	}
	if res, _, ok := lookup(t, lk, released); ok {
		t.Errorf("Lookup of a released key = %v, found; want none", res.State)
	}
}

// testLookupSteps: Lookup names a key's finished steps, not those started
// only, in byte order, and after a release too, until they expire.
func testLookupSteps(t *testing.T, h Harness) {
	lk := need[store.Looker](t, h)
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	for _, name := range []string{"ship", "charge", "email"} {
		startStep(t, st, key, token, name, fpA)
	}
	finishStep(t, st, key, token, "ship", "sh_1")
	finishStep(t, st, key, token, "charge", "ch_1")
	want := []string{"charge", "ship"}
	if _, steps, _ := lookup(t, lk, key); !slices.Equal(steps, want) {
		t.Errorf("Lookup's steps of a run = %q, want %q", steps, want)
	}
	if err := h.Store.Release(tenantContext(), key, token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if _, steps, ok := lookup(t, lk, key); ok || !slices.Equal(steps, want) {
		t.Errorf("Lookup of a released key with steps = steps %q, found %v; want %q, none", steps, ok, want)
	}
	if _, steps, _ := lookup(t, lk, newKey(t, "other")); len(steps) > 0 {
		t.Errorf("Lookup's steps of another key = %q, want none", steps)
	}
	h.Advance(t, retention+time.Second)
	if _, steps, _ := lookup(t, lk, key); len(steps) > 0 {
		t.Errorf("Lookup's steps once they expired = %q, want none", steps)
	}
}

// testLookupAtomic: a key an open atomic transaction holds has no record
// yet; Lookup tells it in progress, or nothing, but never holds the
// running call up: it commits, and a Begin after Lookup acquires a free key.
func testLookupAtomic(t *testing.T, h Harness) {
	at := need[store.Atomic](t, h)
	lk := need[store.Looker](t, h)
	ctx := tenantContext()
	key, free := newKey(t, "k"), newKey(t, "free")
	res, tx, err := at.Begin(ctx, reservation(key, fpA, lease, retention))
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin = %v, %v; want acquired", res.State, err)
	}
	got, _, ok := lookup(t, lk, key)
	if ok && got.State != store.Held {
		t.Errorf("Lookup of a key an atomic call runs = %v; want in progress, or none", got.State)
	}
	if err := tx.Commit(ctx, []byte("reply"), true); err != nil {
		t.Fatalf("Commit after Lookup: %v", err)
	}
	if got, _, ok := lookup(t, lk, key); !ok || got.State != store.Completed || string(got.Outcome) != "reply" {
		t.Errorf("Lookup of a key an atomic call recorded = %v, %q, found %v; want completed, %q", got.State, got.Outcome, ok, "reply")
	}

	if _, _, ok := lookup(t, lk, free); ok {
		t.Fatal("Lookup of an unknown key found a record")
	}
	res, tx, err = at.Begin(ctx, reservation(free, fpA, lease, retention))
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin after Lookup of a free key = %v, %v; want acquired", res.State, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
}
