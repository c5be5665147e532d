package main

import (
	"strings"
	"testing"
)

func TestRatios(t *testing.T) {
	out := `goos: linux
BenchmarkOverhead-2   	   1000	     41000 ns/op	 40000 bare-ns/call	         1.10 first/bare	         1.30 replay/bare	  9000 B/op
BenchmarkOverhead-2   	   1000	     40000 ns/op	         1.20 first/bare	         1.10 replay/bare	  9000 B/op
BenchmarkOverhead-2   	   1000	     42000 ns/op	         1.40 first/bare	         1.20 replay/bare	  9000 B/op
BenchmarkReserveScale-2	   10	  1 insert-p50-ns@1e4	  1.02 insert-p50-1e6/1e4	  130000 swept-rows/s
PASS
`
	rows, err := ratios(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		bench, unit string
		median      float64
		runs        int
	}{
		{"Overhead", "first/bare", 1.20, 3},
		{"Overhead", "replay/bare", 1.20, 3},
		{"ReserveScale", "insert-p50-1e6/1e4", 1.02, 1},
	}
	if len(rows) != len(want) {
		t.Fatalf("%d rows, want %d", len(rows), len(want))
	}
	for i, w := range want {
		r := rows[i]
		if r.bench != w.bench || r.unit != w.unit || median(r.values) != w.median || len(r.values) != w.runs {
			t.Errorf("row %d: %s %s median %v of %d, want %s %s %v of %d", i, r.bench, r.unit, median(r.values), len(r.values), w.bench, w.unit, w.median, w.runs)
		}
	}
}
