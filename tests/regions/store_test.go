package main

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// TestModelIsMemory runs one random sequence of reserves, completes,
// releases and clock steps on the simulation's regional store and on
// store/memory, on one virtual clock, and fails at the first answer in which
// they differ: the simulation's stores keep the contract that idemkey's
// stores keep.
func TestModelIsMemory(t *testing.T) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 7))
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var now time.Duration
	mem := memory.New(memory.WithClock(func() time.Time { return base.Add(now) }))
	var tokens int64
	model := newRegionStore(0, &tokens)
	const keys = 4
	// tokens handed out for each key, in both stores, in order.
	type pair struct {
		model int64
		mem   store.Token
	}
	taken := make([][]pair, keys)
	counts := map[string]int{}
	for step := range 20000 {
		k := rng.IntN(keys)
		key := store.Key{byte(k)}
		switch n := rng.IntN(10); {
		case n < 4:
			fp := uint64(1 + rng.IntN(2))
			lease := time.Duration(1+rng.IntN(5)) * time.Second
			retention := time.Duration(1+rng.IntN(20)) * time.Second
			got := model.reserve(k, fp, lease, retention, now)
			want, err := mem.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{byte(fp)}, Lease: lease, Retention: retention})
			if err != nil {
				t.Fatalf("step %d: memory: %v", step, err)
			}
			if int(got.state) != int(want.State) || (got.state == held && got.retryAfter != want.RetryAfter) {
				t.Fatalf("step %d: reserve: model %v (retry after %v), memory %v (retry after %v)", step, got.state, got.retryAfter, want.State, want.RetryAfter)
			}
			if got.state == acquired {
				taken[k] = append(taken[k], pair{got.token, want.Token})
			}
			counts["reserve "+want.State.String()]++
		case n < 8 && len(taken[k]) > 0:
			p := taken[k][len(taken[k])-1-rng.IntN(min(len(taken[k]), 2))] // the last token, or a stale one
			var got bool
			var err error
			if n < 6 {
				got, err = model.complete(k, p.model, now), mem.Complete(ctx, key, p.mem, []byte("ok"))
			} else {
				got, err = model.release(k, p.model, now), mem.Release(ctx, key, p.mem)
			}
			if err != nil && !errors.Is(err, store.ErrLeaseLost) {
				t.Fatalf("step %d: memory: %v", step, err)
			}
			if got != (err == nil) {
				t.Fatalf("step %d: complete or release: model %v, memory %v", step, got, err)
			}
			counts[map[bool]string{true: "written", false: "lease lost"}[got]]++
		default:
			now += time.Duration(rng.IntN(7)) * 250 * time.Millisecond // on the lease's and retention's edges too
		}
	}
	// Each answer must have come up, or the sequence checked less than it says.
	for _, c := range []string{"reserve acquired", "reserve completed", "reserve in progress", "written", "lease lost"} {
		if counts[c] < 100 {
			t.Errorf("%q came up %d times, want 100 or more: %v", c, counts[c], counts)
		}
	}
}
