// Package benchtest runs several kinds of operation interleaved in one
// benchmark, one of each per iteration in rotating order, so that noise on a
// shared machine (a slow WAL flush, another process) hits them alike and
// their ratios can be trusted.
package benchtest

import (
	"runtime"
	"testing"
	"time"
)

// Op is one kind of operation. Run is called with the iteration's number.
type Op struct {
	Name string
	Run  func(i int) error
	// Before, if set, is called with the same number before each Run, and
	// is neither timed nor counted: it makes what Run needs that is no part
	// of the operation (a new key's metadata).
	Before func(i int)
}

// Interleave runs ops until b is done, reports each one's mean time as
// "<name>-ns/op", and returns the means in nanoseconds, in the order of ops,
// for the caller to report their ratios.
func Interleave(b *testing.B, ops ...Op) []float64 {
	b.Helper()
	spent := make([]time.Duration, len(ops))
	n := 0
	for b.Loop() {
		for j := range ops {
			k := (n + j) % len(ops)
			if ops[k].Before != nil {
				ops[k].Before(n)
			}
			start := time.Now()
			if err := ops[k].Run(n); err != nil {
				b.Fatalf("%s: %v", ops[k].Name, err)
			}
			spent[k] += time.Since(start)
		}
		n++
	}
	means := make([]float64, len(ops))
	for i, op := range ops {
		means[i] = float64(spent[i].Nanoseconds()) / float64(n)
		b.ReportMetric(means[i], op.Name+"-ns/op")
	}
	return means
}

// Allocs runs each of ops runs times, one op after the other rather than
// interleaved, and returns each one's mean allocations per run, counted as
// -benchmem counts them (every allocation of the process while it runs, a
// server's goroutines' too), less those of Before, in the order of ops.
// Counts do not suffer from noise as times do, and reading them costs a stop
// of the world, so they are counted apart from Interleave's times. Run is
// called with 0 to runs-1: an op whose runs must differ from Interleave's (a
// new key each) keeps its own count.
func Allocs(b *testing.B, runs int, ops ...Op) []float64 {
	b.Helper()
	allocs := make([]float64, len(ops))
	for k, op := range ops {
		total := mallocs(func() {
			for i := range runs {
				if op.Before != nil {
					op.Before(i)
				}
				if err := op.Run(i); err != nil {
					b.Fatalf("%s: %v", op.Name, err)
				}
			}
		})
		if op.Before != nil {
			total -= mallocs(func() {
				for i := range runs {
					op.Before(i)
				}
			})
		}
		allocs[k] = float64(total) / float64(runs)
	}
	return allocs
}

// mallocs is how many allocations the process made while f ran.
func mallocs(f func()) int64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return int64(after.Mallocs - before.Mallocs)
}

// ReportAdded reports what each of ops after the first adds to the first
// (the baseline), from the means of Interleave (ns) and of Allocs: the ratio
// of their times ("<name>/<baseline>"), and the microseconds
// ("<name>-added-µs") and the allocations ("<name>-added-allocs") it adds.
func ReportAdded(b *testing.B, ops []Op, ns, allocs []float64) {
	b.Helper()
	for i := 1; i < len(ops); i++ {
		b.ReportMetric(ns[i]/ns[0], ops[i].Name+"/"+ops[0].Name)
		b.ReportMetric((ns[i]-ns[0])/1e3, ops[i].Name+"-added-µs")
		b.ReportMetric(allocs[i]-allocs[0], ops[i].Name+"-added-allocs")
	}
}
