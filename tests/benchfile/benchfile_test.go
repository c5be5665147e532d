package benchfile

import (
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	out := `goos: linux
BenchmarkOverhead-2   	   1000	     41000 ns/op	 40000 bare-ns/call	         1.10 first/bare	         1.30 replay/bare	  9000 B/op
BenchmarkOverhead-2   	   1000	     40000 ns/op	         1.20 first/bare	         1.10 replay/bare	  9000 B/op
BenchmarkOverhead-2   	   1000	     42000 ns/op	         1.40 first/bare	         1.20 replay/bare	  9000 B/op
BenchmarkReserveScale-2	   10	  1 ns/op	 300000 insert-p50-ns@1e4	 400000 replay-p50-ns@1e7	 1.02 insert-p50-1e6/1e4	  130000 swept-rows/s
PASS
`
	metrics, err := Parse(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	first := Find(metrics, "Overhead", "first/bare")
	if first == nil || len(first.Values) != 3 || Median(first.Values) != 1.20 {
		t.Fatalf("Overhead first/bare: %+v, want three runs, median 1.20", first)
	}
	if m := Find(metrics, "ReserveScale", "replay-p50-ns@1e7"); m == nil || m.Values[0] != 400000 {
		t.Errorf("ReserveScale replay-p50-ns@1e7: %+v, want 400000", m)
	}
	if m := Find(metrics, "Overhead", "bare-ns/call"); m == nil || len(m.Values) != 1 {
		t.Errorf("a unit of one run only: %+v", m)
	}
	if Median([]float64{1, 2}) != 1.5 {
		t.Error("the median of an even count is the mean of the middle two")
	}
	for unit, want := range map[string]bool{
		"first/bare": true, "insert-p50-1e6/1e4": true, "atomic/bare": true,
		"ns/op": false, "B/op": false, "bare-ns/call": false, "swept-rows/s": false, "insert-p50-ns@1e4": false,
	} {
		if IsRatio(unit) != want {
			t.Errorf("IsRatio(%q) = %v, want %v", unit, !want, want)
		}
	}
	if _, err := Parse(strings.NewReader("BenchmarkX-2 1 abc ns/op\n")); err == nil {
		t.Error("a value that is not a number parsed")
	}
}
