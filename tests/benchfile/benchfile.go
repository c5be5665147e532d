// Package benchfile reads the output of `go test -bench -count=N`: every
// value of every unit a benchmark reported, per benchmark and unit, one per
// run. internal/benchtable prints its ratios as a table, internal/chart
// draws them.
package benchfile

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
)

// Metric is one unit of one benchmark ("Overhead", "first/bare"), with its
// value in each run, in the order of the output.
type Metric struct {
	Bench, Unit string
	Values      []float64
}

// Parse reads benchmark result lines ("BenchmarkName-2 N value unit ...").
// Metrics keep the order in which they first appear.
func Parse(r io.Reader) ([]*Metric, error) {
	var metrics []*Metric
	index := map[string]*Metric{}
	lines := bufio.NewScanner(r)
	lines.Buffer(nil, 1<<20)
	for lines.Scan() {
		fields := strings.Fields(lines.Text())
		if len(fields) < 4 || !strings.HasPrefix(fields[0], "Benchmark") {
			continue
		}
		bench := strings.TrimPrefix(fields[0], "Benchmark")
		if i := strings.LastIndexByte(bench, '-'); i > 0 {
			bench = bench[:i] // the GOMAXPROCS suffix
		}
		for i := 2; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return nil, fmt.Errorf("%s: %s is not a number", bench, fields[i])
			}
			key := bench + " " + fields[i+1]
			if index[key] == nil {
				index[key] = &Metric{Bench: bench, Unit: fields[i+1]}
				metrics = append(metrics, index[key])
			}
			index[key].Values = append(index[key].Values, v)
		}
	}
	return metrics, lines.Err()
}

// Find returns the metric of bench and unit, or nil.
func Find(metrics []*Metric, bench, unit string) *Metric {
	for _, m := range metrics {
		if m.Bench == bench && m.Unit == unit {
			return m
		}
	}
	return nil
}

// IsRatio reports whether unit is an interleaved ratio ("first/bare"),
// rather than a cost per operation ("ns/op", "B/op", "bare-ns/call") or a
// rate ("swept-rows/s").
func IsRatio(unit string) bool {
	left, right, ok := strings.Cut(unit, "/")
	return ok && right != "op" && right != "call" && right != "s" && !strings.HasSuffix(left, "ns") && !strings.HasSuffix(left, "sec")
}

// Median is the median of vs, which must not be empty.
func Median(vs []float64) float64 {
	s := slices.Sorted(slices.Values(vs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
