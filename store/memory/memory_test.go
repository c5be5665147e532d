package memory_test

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		c := storetest.NewClock()
		return storetest.Harness{Store: memory.New(memory.WithClock(c.Now)), Advance: c.Advance}
	})
}

// Memory stays bounded by retention without anyone calling Sweep.
func TestReserveEvictsExpired(t *testing.T) {
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now))
	ctx := context.Background()
	const perRound = 1000
	for round := range 5 {
		for i := range perRound {
			key := store.ScopeKey("t", "/m", string(rune(round*perRound+i)))
			res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Second, Retention: time.Minute})
			if err != nil || res.State != store.Acquired {
				t.Fatalf("Reserve = %v, %v", res.State, err)
			}
			if err := st.Complete(ctx, key, res.Token, []byte("ok")); err != nil {
				t.Fatal(err)
			}
		}
		c.Advance(t, time.Hour)
	}
	// Each round's reserves evicted the previous round's expired records.
	if n := st.Len(); n > perRound {
		t.Errorf("store holds %d records after 5 rounds of %d with retention passing between them; want at most %d", n, perRound, perRound)
	}
}

func TestCanceledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st := memory.New()
	if _, err := st.Reserve(ctx, store.Reservation{Key: store.ScopeKey("t", "/m", "k")}); err != context.Canceled {
		t.Errorf("Reserve on a canceled context: err = %v, want context.Canceled", err)
	}
}

// At its record bound the store refuses new keys with ErrFull, replays what
// it holds, and makes room by deleting expired records first.
func TestMaxRecords(t *testing.T) {
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now), memory.WithMaxRecords(3))
	ctx := context.Background()
	reserve := func(k string) (store.Entry, error) {
		return st.Reserve(ctx, store.Reservation{Key: store.ScopeKey("t", "/m", k), Lease: time.Second, Retention: time.Minute})
	}
	for _, k := range []string{"a", "b", "c"} {
		res, err := reserve(k)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Complete(ctx, store.ScopeKey("t", "/m", k), res.Token, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := reserve("d"); !errors.Is(err, store.ErrFull) {
		t.Fatalf("a fourth key with room for three: err = %v, want ErrFull", err)
	}
	if res, err := reserve("a"); err != nil || res.State != store.Completed || string(res.Outcome) != "a" {
		t.Fatalf("replay of a recorded key in a full store: %v, %q, %v", res.State, res.Outcome, err)
	}
	c.Advance(t, time.Hour)
	if res, err := reserve("d"); err != nil || res.State != store.Acquired {
		t.Fatalf("a new key once the others expired: %v, %v", res.State, err)
	}
	if n := st.Len(); n > 2 {
		t.Errorf("%d records held, want at most 2: the expired ones go first", n)
	}
}

// At its byte bound the store refuses an outcome that does not fit, and still
// takes a short one (store.SmallOutcome) for the same token.
func TestMaxBytes(t *testing.T) {
	st := memory.New(memory.WithMaxBytes(4 << 10))
	ctx := context.Background()
	key := store.ScopeKey("t", "/m", "k")
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Second, Retention: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Complete(ctx, key, res.Token, make([]byte, 8<<10)); !errors.Is(err, store.ErrFull) {
		t.Fatalf("an 8 KiB outcome in a 4 KiB store: err = %v, want ErrFull", err)
	}
	if err := st.Complete(ctx, key, res.Token, make([]byte, store.SmallOutcome)); err != nil {
		t.Fatalf("a short outcome after ErrFull: %v", err)
	}
	for i := 0; ; i++ {
		k := store.ScopeKey("t", "/m", string(rune(i)))
		res, err := st.Reserve(ctx, store.Reservation{Key: k, Lease: time.Second, Retention: time.Minute})
		if errors.Is(err, store.ErrFull) {
			if i < 4 { // 4 KiB holds 8 records of 512 bytes, and one is taken
				t.Fatalf("full after %d more records", i)
			}
			break
		}
		if err != nil || res.State != store.Acquired {
			t.Fatalf("Reserve = %v, %v", res.State, err)
		}
	}
}

// A step's record counts against the bounds as a record does, its result
// as the outcome: past a bound StartStep and FinishStep write nothing. It
// stays counted after Release, and an expired one makes room for new keys.
func TestStepsCountAgainstBounds(t *testing.T) {
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now), memory.WithMaxRecords(3), memory.WithMaxBytes(4<<10))
	ctx := context.Background()
	reserve := func(k string) (store.Key, store.Entry, error) {
		key := store.ScopeKey("t", "/m", k)
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Second, Retention: time.Minute})
		return key, res, err
	}
	start := func(key store.Key, token store.Token, name string) (store.StepEntry, error) {
		return st.StartStep(ctx, store.StepStart{Key: key, Name: name, Token: token})
	}
	key, res, err := reserve("k")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b"} {
		if step, err := start(key, res.Token, name); err != nil || step.State != store.StepNew {
			t.Fatalf("StartStep(%s) = %v, %v; want StepNew", name, step.State, err)
		}
	}
	if n, b := st.Len(), st.Bytes(); n != 3 || b != 3*memory.RecordCost {
		t.Fatalf("a record and two steps count %d records, %d bytes; want 3, %d", n, b, 3*memory.RecordCost)
	}
	for range 2 {
		if _, err := start(key, res.Token, "c"); !errors.Is(err, store.ErrFull) {
			t.Fatalf("a third step with room for three records: err = %v, want ErrFull", err)
		}
	}
	if err := st.FinishStep(ctx, key, res.Token, "a", make([]byte, 8<<10)); !errors.Is(err, store.ErrFull) {
		t.Fatalf("an 8 KiB result in a 4 KiB store: err = %v, want ErrFull", err)
	}
	if step, err := start(key, res.Token, "a"); err != nil || step.State != store.StepStarted {
		t.Fatalf("StartStep after a refused FinishStep = %v, %v; want StepStarted", step.State, err)
	}
	if n, b := st.Len(), st.Bytes(); n != 3 || b != 3*memory.RecordCost {
		t.Fatalf("after ErrFull: %d records, %d bytes; want 3, %d", n, b, 3*memory.RecordCost)
	}
	if err := st.FinishStep(ctx, key, res.Token, "a", make([]byte, 1<<10)); err != nil {
		t.Fatalf("a 1 KiB result: %v", err)
	}
	if b, want := st.Bytes(), int64(3*memory.RecordCost+1<<10-store.SmallOutcome); b != want {
		t.Fatalf("with a 1 KiB result: %d bytes; want %d", b, want)
	}

	if err := st.Release(ctx, key, res.Token); err != nil {
		t.Fatal(err)
	}
	if n := st.Len(); n != 2 {
		t.Fatalf("after Release: %d records; want the 2 steps", n)
	}
	c.Advance(t, time.Minute+time.Second)
	for _, k := range []string{"x", "y", "z"} {
		if _, _, err := reserve(k); err != nil {
			t.Fatalf("Reserve(%s) with the steps expired: %v", k, err)
		}
	}
	if n, b := st.Len(), st.Bytes(); n != 3 || b != 3*memory.RecordCost {
		t.Fatalf("3 new keys: %d records, %d bytes; want 3, %d", n, b, 3*memory.RecordCost)
	}
}

// A flood of unique keys with large replies leaves the heap within three
// times the byte bound of where it started: the bound the package doc states.
func TestFloodStaysBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("a flood of 200,000 keys")
	}
	const maxBytes = 16 << 20
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	st := memory.New(memory.WithMaxBytes(maxBytes), memory.WithMaxRecords(1<<30))
	ctx := context.Background()
	full := 0
	for i := range 200_000 {
		key := store.ScopeKey("t", "/m", strconv.Itoa(i))
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Minute, Retention: time.Hour})
		if errors.Is(err, store.ErrFull) {
			full++
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		outcome := make([]byte, 100+i%(64<<10)) // up to 64 KiB, 6 GB in all
		if err := st.Complete(ctx, key, res.Token, outcome); errors.Is(err, store.ErrFull) {
			err = st.Complete(ctx, key, res.Token, outcome[:store.SmallOutcome])
			if err != nil {
				t.Fatal(err)
			}
		} else if err != nil {
			t.Fatal(err)
		}
	}
	grown := int64(heap()) - int64(before)
	t.Logf("heap grew %d MiB for a %d MiB bound, %d records held, %d refused", grown>>20, maxBytes>>20, st.Len(), full)
	if grown > 3*maxBytes {
		t.Errorf("heap grew %d MiB, more than 3 times the %d MiB bound", grown>>20, maxBytes>>20)
	}
	if full == 0 {
		t.Error("no reservation was refused; the flood did not reach the bound")
	}
	runtime.KeepAlive(st)
}

// reservation asks for key of tenant, with room for an outcome of maxOutcome
// bytes, as the engine does.
func reservation(tenant, key string, maxOutcome int) store.Reservation {
	return store.Reservation{
		Key:        store.ScopeKey(tenant, "/m", key),
		Lease:      time.Minute,
		Retention:  time.Hour,
		MaxOutcome: maxOutcome,
		Partition:  store.TenantPartition(tenant),
	}
}

// reserveAll makes every reservation of rs at once and returns the tokens of
// those acquired, by index in rs, and how many were refused with ErrFull.
func reserveAll(t *testing.T, st *memory.Store, rs []store.Reservation) (map[int]store.Token, int) {
	t.Helper()
	var (
		mu       sync.Mutex
		wg       sync.WaitGroup
		start    = make(chan struct{})
		acquired = map[int]store.Token{}
		full     int
	)
	for i, r := range rs {
		wg.Go(func() {
			<-start
			res, err := st.Reserve(context.Background(), r)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case errors.Is(err, store.ErrFull):
				full++
			case err != nil || res.State != store.Acquired:
				t.Errorf("Reserve of a new key: %v, %v; want acquired or ErrFull", res.State, err)
			default:
				acquired[i] = res.Token
			}
		})
	}
	close(start)
	wg.Wait()
	return acquired, full
}

// completeAll completes every acquired reservation of rs at once, each with an
// outcome of size bytes, and fails the test if any is refused.
func completeAll(t *testing.T, st *memory.Store, rs []store.Reservation, acquired map[int]store.Token, size int) {
	t.Helper()
	var wg sync.WaitGroup
	for i, token := range acquired {
		wg.Go(func() {
			if err := st.Complete(context.Background(), rs[i].Key, token, make([]byte, size)); err != nil {
				t.Errorf("Complete of an outcome of %d bytes, within the reservation's MaxOutcome of %d: %v", size, rs[i].MaxOutcome, err)
			}
		})
	}
	wg.Wait()
}

func newKeys(tenant, prefix string, n, maxOutcome int) []store.Reservation {
	rs := make([]store.Reservation, n)
	for i := range rs {
		rs[i] = reservation(tenant, prefix+strconv.Itoa(i), maxOutcome)
	}
	return rs
}

// perCall is what a call with room for an outcome of maxOutcome bytes counts
// while it runs.
func perCall(maxOutcome int) int64 {
	return memory.RecordCost + int64(maxOutcome) - store.SmallOutcome
}

// A new key is let in only with room for the largest outcome it may record:
// a store with room for n such calls lets in n of n+1 concurrent new keys,
// every one it lets in records an outcome of that size, and what a smaller
// outcome did not take comes back.
func TestReserveSetsRoomAside(t *testing.T) {
	const (
		n          = 8
		maxOutcome = 64 << 10
	)
	st := memory.New(memory.WithMaxBytes(n*perCall(maxOutcome) + perCall(maxOutcome)/2))

	first := newKeys("", "first-", n+1, maxOutcome)
	acquired, full := reserveAll(t, st, first)
	if len(acquired) != n || full != 1 {
		t.Fatalf("%d concurrent new keys with room for %d: %d acquired, %d refused; want %d and 1", n+1, n, len(acquired), full, n)
	}
	completeAll(t, st, first, acquired, 100)

	// n small records leave room for n more calls, and no more.
	second := newKeys("", "second-", n+1, maxOutcome)
	acquired, full = reserveAll(t, st, second)
	if len(acquired) != n || full != 1 {
		t.Fatalf("after %d small records, %d concurrent new keys: %d acquired, %d refused; want %d and 1", n, n+1, len(acquired), full, n)
	}
	// The store is at its bound, and each of them records its largest outcome.
	completeAll(t, st, second, acquired, maxOutcome)
	for i := range acquired {
		res, err := st.Reserve(context.Background(), second[i])
		if err != nil || res.State != store.Completed || len(res.Outcome) != maxOutcome {
			t.Fatalf("replay: %v with %d bytes, %v; want completed with %d", res.State, len(res.Outcome), err, maxOutcome)
		}
	}
	if _, err := st.Reserve(context.Background(), reservation("", "third", maxOutcome)); !errors.Is(err, store.ErrFull) {
		t.Errorf("a new key in a full store: %v, want ErrFull", err)
	}
}

// Release frees all the room a call set aside, and a takeover of a dead
// call's key sets aside no more than once.
func TestReleaseAndTakeoverFreeRoom(t *testing.T) {
	const (
		n          = 4
		maxOutcome = 64 << 10
	)
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now), memory.WithMaxBytes(n*perCall(maxOutcome)))
	ctx := context.Background()
	rs := newKeys("", "k", n, maxOutcome)
	acquired, _ := reserveAll(t, st, rs)
	if len(acquired) != n {
		t.Fatalf("%d of %d acquired", len(acquired), n)
	}
	for i, token := range acquired {
		if err := st.Release(ctx, rs[i].Key, token); err != nil {
			t.Fatal(err)
		}
	}
	if b := st.Bytes(); b != 0 {
		t.Errorf("%d bytes counted after every call released, want 0", b)
	}
	if acquired, _ = reserveAll(t, st, rs); len(acquired) != n {
		t.Fatalf("after release: %d of %d acquired", len(acquired), n)
	}
	before := st.Bytes()
	c.Advance(t, 2*time.Minute) // every lease has ended
	for _, r := range rs {
		if res, err := st.Reserve(ctx, r); err != nil || res.State != store.Acquired {
			t.Fatalf("takeover after the lease: %v, %v; want acquired", res.State, err)
		}
	}
	if after := st.Bytes(); after != before {
		t.Errorf("takeovers changed the bytes counted from %d to %d", before, after)
	}
}

// No tenant takes more than its share of either bound (half by default), so
// that one tenant's flood leaves room for the others' new keys; calls
// without a tenant are bounded by the whole store alone.
func TestTenantShare(t *testing.T) {
	const maxOutcome = 64 << 10
	t.Run("bytes", func(t *testing.T) {
		st := memory.New(memory.WithMaxBytes(8 * perCall(maxOutcome)))
		acquired, full := reserveAll(t, st, newKeys("acme", "k", 8, maxOutcome))
		if len(acquired) != 4 || full != 4 {
			t.Fatalf("one tenant's 8 concurrent calls in a store with room for 8: %d acquired, %d refused; want 4 and 4", len(acquired), full)
		}
		if acquired, _ := reserveAll(t, st, newKeys("globex", "k", 4, maxOutcome)); len(acquired) != 4 {
			t.Errorf("another tenant while the first holds its share: %d of 4 acquired", len(acquired))
		}
	})
	t.Run("records", func(t *testing.T) {
		st := memory.New(memory.WithMaxRecords(10))
		ctx := context.Background()
		fill := func(tenant string) int {
			for i := range 10 {
				r := reservation(tenant, strconv.Itoa(i), 0)
				res, err := st.Reserve(ctx, r)
				if errors.Is(err, store.ErrFull) {
					return i
				}
				if err != nil {
					t.Fatal(err)
				}
				if err := st.Complete(ctx, r.Key, res.Token, []byte("ok")); err != nil {
					t.Fatal(err)
				}
			}
			return 10
		}
		if n := fill("acme"); n != 5 {
			t.Errorf("one tenant recorded %d keys in a store of 10 records, want 5", n)
		}
		if n := fill("globex"); n != 5 {
			t.Errorf("another tenant recorded %d keys after the first took its share, want 5", n)
		}
	})
	t.Run("no tenant", func(t *testing.T) {
		st := memory.New(memory.WithMaxBytes(8 * perCall(maxOutcome)))
		if acquired, _ := reserveAll(t, st, newKeys("", "k", 8, maxOutcome)); len(acquired) != 8 {
			t.Errorf("calls without a tenant: %d of 8 acquired, want the whole store", len(acquired))
		}
	})
	t.Run("WithTenantShare", func(t *testing.T) {
		for _, tc := range []struct {
			share float64
			want  int
		}{{0.25, 2}, {1, 8}, {2, 8}, {0, 4}, {-1, 4}} {
			st := memory.New(memory.WithMaxBytes(8*perCall(maxOutcome)), memory.WithTenantShare(tc.share))
			if acquired, _ := reserveAll(t, st, newKeys("acme", "k", 8, maxOutcome)); len(acquired) != tc.want {
				t.Errorf("WithTenantShare(%v): one tenant acquired %d of 8, want %d", tc.share, len(acquired), tc.want)
			}
		}
	})
	t.Run("larger than the share", func(t *testing.T) {
		// A call whose largest outcome is more than its tenant may hold
		// takes the whole share, and runs while its tenant holds nothing
		// else.
		st := memory.New(memory.WithMaxBytes(perCall(maxOutcome)))
		acquired, full := reserveAll(t, st, newKeys("acme", "k", 2, maxOutcome))
		if len(acquired) != 1 || full != 1 {
			t.Fatalf("two calls too large for the share: %d acquired, %d refused; want 1 and 1", len(acquired), full)
		}
	})
}

// Under concurrent reserves, completes, releases, takeovers and expiry, the
// bytes counted never pass the bound, every outcome within its reservation is
// recorded, and once every record has expired and been swept nothing is
// counted.
func TestRoomAccountingUnderConcurrency(t *testing.T) {
	const maxBytes = 256 << 10
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now), memory.WithMaxBytes(maxBytes), memory.WithMaxRecords(200))
	ctx := context.Background()
	tenants := []string{"", "acme", "globex", "initech"}
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		abandoned []store.Reservation
	)
	for g := range 16 {
		wg.Go(func() {
			for i := range 100 {
				n := g*100 + i
				maxOutcome := []int{0, 1 << 10, 16 << 10, 64 << 10}[n%4]
				r := reservation(tenants[n%len(tenants)], strconv.Itoa(n), maxOutcome)
				res, err := st.Reserve(ctx, r)
				if errors.Is(err, store.ErrFull) {
					continue
				}
				if err != nil || res.State != store.Acquired {
					t.Errorf("Reserve: %v, %v", res.State, err)
					return
				}
				if b := st.Bytes(); b > maxBytes {
					t.Errorf("%d bytes counted, past the bound of %d", b, maxBytes)
				}
				switch n % 5 {
				case 0:
					if err := st.Release(ctx, r.Key, res.Token); err != nil {
						t.Error(err)
					}
				case 1:
					mu.Lock()
					abandoned = append(abandoned, r)
					mu.Unlock()
				default:
					if err := st.Complete(ctx, r.Key, res.Token, make([]byte, n*37%(maxOutcome+1))); err != nil {
						t.Errorf("Complete within MaxOutcome %d: %v", maxOutcome, err)
					}
				}
			}
		})
	}
	wg.Wait()
	c.Advance(t, 2*time.Minute) // the abandoned calls' leases end
	for _, r := range abandoned {
		res, err := st.Reserve(ctx, r)
		if err != nil || res.State != store.Acquired {
			t.Fatalf("takeover: %v, %v", res.State, err)
		}
		if err := st.Complete(ctx, r.Key, res.Token, make([]byte, r.MaxOutcome)); err != nil {
			t.Errorf("Complete of a taken-over key within MaxOutcome: %v", err)
		}
	}
	if b := st.Bytes(); b > maxBytes {
		t.Errorf("%d bytes counted, past the bound of %d", b, maxBytes)
	}
	c.Advance(t, 2*time.Hour)
	if _, err := st.Sweep(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if n, b := st.Len(), st.Bytes(); n != 0 || b != 0 {
		t.Errorf("after every record expired and was swept: %d records, %d bytes counted; want none", n, b)
	}
}

// TestWatchKeepsNothing: the store keeps nothing of a Watch once it is
// stopped, or once its key is completed, released or swept.
func TestWatchKeepsNothing(t *testing.T) {
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now))
	ctx := context.Background()
	acquire := func(name string, lease time.Duration) (store.Key, store.Token) {
		key := store.ScopeKey("t", "/m", name)
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: lease, Retention: time.Minute})
		if err != nil || res.State != store.Acquired {
			t.Fatalf("Reserve = %v, %v", res.State, err)
		}
		return key, res.Token
	}
	stopped, _ := acquire("stopped", time.Minute)
	var stops []func()
	for range 3 {
		_, stop := st.Watch(stopped)
		stops = append(stops, stop)
	}
	for _, stop := range stops {
		stop()
	}
	completed, token := acquire("completed", time.Minute)
	st.Watch(completed)
	released, releasedToken := acquire("released", time.Minute)
	st.Watch(released)
	swept, _ := acquire("swept", time.Second)
	st.Watch(swept)
	if n := st.Watched(); n != 3 {
		t.Fatalf("%d keys watched, want 3: all but the one whose Watches stopped", n)
	}
	if err := st.Complete(ctx, completed, token, []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if err := st.Release(ctx, released, releasedToken); err != nil {
		t.Fatal(err)
	}
	c.Advance(t, 2*time.Minute) // past the swept key's retention and lease, and the others'
	if _, err := st.Sweep(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if n := st.Watched(); n != 0 {
		t.Fatalf("%d keys watched after their records were completed, released, swept or their Watches stopped, want 0", n)
	}
}

// From 16 goroutines at once, over keys they share and keys of their own,
// in several tenants, each key runs once and every duplicate, waiting for
// it (Watch) or not, gets the first reply; the store then counts every key
// once.
func TestHammer(t *testing.T) {
	const goroutines, shared, own = 16, 64, 200
	st := memory.New()
	ctx := context.Background()
	tenants := []string{"", "acme", "globex"}
	var (
		mu       sync.Mutex
		runs     = map[store.Key]int{}
		first    = map[store.Key]string{}
		replies  = map[store.Key][]string{}
		wg       sync.WaitGroup
		reserves atomic.Int64
	)
	call := func(g int, r store.Reservation) {
		for {
			reserves.Add(1)
			res, err := st.Reserve(ctx, r)
			if err != nil {
				t.Error(err)
				return
			}
			switch res.State {
			case store.Acquired:
				reply := "run by " + strconv.Itoa(g)
				mu.Lock()
				runs[r.Key]++
				first[r.Key] = reply
				mu.Unlock()
				if err := st.Complete(ctx, r.Key, res.Token, []byte(reply)); err != nil {
					t.Error(err)
				}
				return
			case store.Completed:
				mu.Lock()
				replies[r.Key] = append(replies[r.Key], string(res.Outcome))
				mu.Unlock()
				return
			default: // held: wait for the first call, then ask again
				changed, stop := st.Watch(r.Key)
				<-changed
				stop()
			}
		}
	}
	for g := range goroutines {
		wg.Go(func() {
			for i := range shared + own {
				name := "own-" + strconv.Itoa(g) + "-" + strconv.Itoa(i)
				if i%4 == 0 && i/4 < shared { // every goroutine takes them in the same order
					name = "shared-" + strconv.Itoa(i/4)
				}
				tenant := tenants[len(name)%len(tenants)]
				call(g, store.Reservation{Key: store.ScopeKey(tenant, "/m", name), Lease: time.Minute,
					Retention: time.Hour, Partition: store.TenantPartition(tenant)})
			}
		})
	}
	wg.Wait()
	keys := len(runs)
	for key, n := range runs {
		if n != 1 {
			t.Errorf("key %v ran %d times", key, n)
		}
		for _, reply := range replies[key] {
			if reply != first[key] {
				t.Errorf("key %v replayed %q, want the first reply %q", key, reply, first[key])
			}
		}
	}
	if want := goroutines*own + shared; keys != want {
		t.Errorf("%d keys ran, want %d", keys, want)
	}
	if n := st.Len(); n != keys {
		t.Errorf("the store holds %d records for %d keys", n, keys)
	}
	if b := st.Bytes(); b != int64(keys)*memory.RecordCost {
		t.Errorf("the store counts %d bytes for %d small records, want %d", b, keys, int64(keys)*memory.RecordCost)
	}
	t.Logf("%d keys, %d reserves", keys, reserves.Load())
}
