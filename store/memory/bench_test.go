package memory_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkParallel calls the store from 16 goroutines at once, as the
// engine does: a first call (Reserve of a new key, then Complete) and a
// replay (Reserve of one of 1,024 recorded keys). Besides time and
// -benchmem's allocations it reports the calls per second, the CPU per call
// and, with -mutexprofile, the share of the goroutines' time spent waiting
// for the store's locks (benchtest.Parallel).
func BenchmarkParallel(b *testing.B) {
	const goroutines, keys = 16, 1024
	ctx := context.Background()
	outcome := make([]byte, 200)
	reservation := func(key string) store.Reservation {
		return store.Reservation{Key: store.ScopeKey("t", "/m", key), Lease: time.Minute,
			Retention: time.Hour, MaxOutcome: 4 << 10, Partition: store.TenantPartition("t")}
	}
	recorded := make([]store.Reservation, keys)
	for i := range recorded {
		recorded[i] = reservation("replay-" + strconv.Itoa(i))
	}
	var fresh atomic.Int64
	for _, v := range []struct {
		name string
		call func(st *memory.Store, i int) error
	}{
		{"first", func(st *memory.Store, _ int) error {
			r := reservation("first-" + strconv.FormatInt(fresh.Add(1), 10))
			res, err := st.Reserve(ctx, r)
			if err != nil {
				return err
			}
			return st.Complete(ctx, r.Key, res.Token, outcome)
		}},
		{"replay", func(st *memory.Store, i int) error {
			res, err := st.Reserve(ctx, recorded[i%keys])
			if err == nil && res.State != store.Completed {
				b.Errorf("replay: %v", res.State)
			}
			return err
		}},
	} {
		b.Run(v.name, func(b *testing.B) {
			st := memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40), memory.WithTenantShare(1))
			for _, r := range recorded {
				res, err := st.Reserve(ctx, r)
				if err != nil {
					b.Fatal(err)
				}
				if err := st.Complete(ctx, r.Key, res.Token, outcome); err != nil {
					b.Fatal(err)
				}
			}
			benchtest.Parallel(b, goroutines, "store/memory.", func(g int) func() {
				i := g * keys / goroutines // each starts at its own key
				return func() {
					if err := v.call(st, i); err != nil {
						b.Error(err)
					}
					i++
				}
			})
		})
	}
}
