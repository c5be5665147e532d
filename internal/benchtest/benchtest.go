// Package benchtest runs several kinds of operation interleaved in one
// benchmark, one of each per iteration in rotating order, so that noise on a
// shared machine (a slow WAL flush, another process) hits them alike and
// their ratios can be trusted.
package benchtest

import (
	"testing"
	"time"
)

// Op is one kind of operation. Run is called with the iteration's number.
type Op struct {
	Name string
	Run  func(i int) error
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
