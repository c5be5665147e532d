package memory_test

import (
	"context"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkParallel calls the store from 16 goroutines at once, as the
// engine does: a first call (Reserve of a new key, then Complete) and a
// replay (Reserve of one of 1,024 recorded keys). Besides time and
// -benchmem's allocations it reports the share of the goroutines' time spent
// waiting for a sync.Mutex.
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
			var worker atomic.Int64
			b.SetParallelism((goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			wait0, start := mutexWait(), time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(worker.Add(1)) * keys / goroutines
				for pb.Next() {
					if err := v.call(st, i); err != nil {
						b.Error(err)
						return
					}
					i++
				}
			})
			b.StopTimer()
			b.ReportMetric(100*(mutexWait()-wait0)/(goroutines*time.Since(start).Seconds()), "mutex-wait-%")
		})
	}
}

// mutexWait is the seconds goroutines have spent blocked on a sync.Mutex or
// sync.RWMutex so far.
func mutexWait() float64 {
	s := []metrics.Sample{{Name: "/sync/mutex/wait/total:seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 {
		return 0
	}
	return s[0].Value.Float64()
}
