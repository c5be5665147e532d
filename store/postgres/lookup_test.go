package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Lookup tells a key that a running atomic call holds in progress, from its
// lock, at once; the call commits as if nothing had asked, and a
// transaction of another replica that tries the key's lock afterwards gets
// it once the call has ended.
func TestLookupAtomicRunning(t *testing.T) {
	rs := newReplicas(t, 2)
	ctx := context.Background()
	key := store.ScopeKey("acme", "/m", "running")
	r := store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour}
	res, tx, err := rs[0].store.Begin(ctx, r)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin = %v, %v; want acquired", res.State, err)
	}
	for _, rep := range rs {
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		start := time.Now()
		got, steps, ok, err := rep.store.Lookup(lctx, key)
		cancel()
		if err != nil || !ok || got.State != store.Held || got.RetryAfter != time.Second || len(steps) > 0 {
			t.Errorf("Lookup of a key an atomic call holds = %v, retry after %v, steps %q, found %v, %v; want in progress, 1s",
				got.State, got.RetryAfter, steps, ok, err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("Lookup of a key an atomic call holds took %v; want an answer at once", took)
		}
	}
	if err := tx.Commit(ctx, []byte("reply"), true); err != nil {
		t.Fatalf("Commit after Lookup: %v", err)
	}
	got, _, ok, err := rs[1].store.Lookup(ctx, key)
	if err != nil || !ok || got.State != store.Completed || string(got.Outcome) != "reply" || got.Expires.IsZero() {
		t.Errorf("Lookup after the commit = %v, %q, expires %v, found %v, %v; want completed, %q, an expiry", got.State, got.Outcome, got.Expires, ok, err, "reply")
	}

	// Lookups in a loop never make a new key's Begin fail: at worst a
	// Begin in the instant of a Lookup hears "in progress" and asks again.
	other := store.Reservation{Key: store.ScopeKey("acme", "/m", "new"), Fingerprint: store.Fingerprint{2}, Lease: time.Minute, Retention: time.Hour}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, _, _, err := rs[1].store.Lookup(ctx, other.Key); err != nil {
				t.Errorf("Lookup: %v", err)
				return
			}
		}
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		res, tx, err := rs[0].store.Begin(ctx, other)
		if err != nil {
			t.Fatalf("Begin beside Lookups: %v", err)
		}
		if res.State == store.Acquired {
			_ = tx.Rollback(ctx)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Begin beside Lookups = %v until %v; want acquired", res.State, deadline)
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	<-done
}
