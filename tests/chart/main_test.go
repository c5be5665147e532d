package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const benchOutput = `goos: linux
BenchmarkOverhead-2   	   1000	     41000 ns/op	         1.10 first/bare	         1.30 replay/bare	  9000 B/op
BenchmarkOverhead-2   	   1000	     40000 ns/op	         1.20 first/bare	         1.10 replay/bare	  9000 B/op
BenchmarkReserveScale-2	   10	  1 ns/op	 300000 insert-p50-ns@1e4	 330000 insert-p50-ns@1e6	 360000 insert-p50-ns@1e7	 1.1 insert-p50-1e6/1e4
BenchmarkReserveScale-2	   10	  1 ns/op	 100000 replay-p50-ns@1e4	 200000 replay-p50-ns@1e6	 400000 replay-p50-ns@1e7	 2.0 replay-p50-1e6/1e4
PASS
`

// Each chart is written from the inputs, as SVG.
func TestCharts(t *testing.T) {
	dir := t.TempDir()
	bench := filepath.Join(dir, "bench.txt")
	if err := os.WriteFile(bench, []byte(benchOutput), 0o644); err != nil {
		t.Fatal(err)
	}
	load, err := json.Marshal(map[string]any{
		"cpus": 2, "clients": 16, "rounds": 5, "run_duration": "2s",
		"rows": []map[string]any{
			{"mode": "bare", "mix": "new", "per_second": 4000, "cpu_server_us": 100, "cpu_load_us": 100, "cpu_postgres_us": 120, "cpu_rest_us": 10},
			{"mode": "atomic", "mix": "new", "per_second": 2000, "cpu_server_us": 250, "cpu_load_us": 120, "cpu_postgres_us": 400, "cpu_rest_us": -5},
			{"mode": "atomic", "mix": "pgbench", "per_second": 4200, "cpu_load_us": 50, "cpu_postgres_us": 260},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	loadPath := filepath.Join(dir, "load.json")
	if err := os.WriteFile(loadPath, load, 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "charts")
	if err := run(bench, loadPath, out); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"reserve-scale", "bench-ratios", "load-throughput", "load-cpu"} {
		svg, err := os.ReadFile(filepath.Join(out, name+".svg"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(svg), "<svg") {
			t.Errorf("%s.svg is not SVG", name)
		}
	}
	if err := run("", "", out); err == nil {
		t.Error("run with no input drew nothing and reported no error")
	}
}
