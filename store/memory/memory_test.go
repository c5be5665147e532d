package memory_test

import (
	"context"
	"errors"
	"runtime"
	"strconv"
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
	reserve := func(k string) (store.Result, error) {
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
