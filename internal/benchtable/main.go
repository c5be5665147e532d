// Command benchtable prints the ratios that benchmarks report (units such as
// "first/bare"), from one `go test -bench -count=N` output, as one Markdown
// table: per benchmark and ratio, the median of the N runs and their range.
// make bench runs it on bin/bench.txt.
//
//	go run ./internal/benchtable bin/bench.txt
package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: benchtable FILE")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	rows, err := ratios(f)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("| benchmark | ratio | median | range | runs |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %.3f | %.3f–%.3f | %d |\n", r.bench, r.unit, median(r.values), slices.Min(r.values), slices.Max(r.values), len(r.values))
	}
}

// row is one ratio of one benchmark, over every run.
type row struct {
	bench, unit string
	values      []float64
}

// ratios reads benchmark result lines ("BenchmarkName-2 N value unit ...")
// and collects the values of every unit that is a ratio (see isRatio). Rows
// keep the order in which they first appear.
func ratios(r io.Reader) ([]*row, error) {
	var rows []*row
	index := map[string]*row{}
	lines := bufio.NewScanner(r)
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
			unit := fields[i+1]
			if !isRatio(unit) {
				continue
			}
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return nil, fmt.Errorf("%s: %s is not a number", bench, fields[i])
			}
			key := bench + " " + unit
			if index[key] == nil {
				index[key] = &row{bench: bench, unit: unit}
				rows = append(rows, index[key])
			}
			index[key].values = append(index[key].values, v)
		}
	}
	return rows, lines.Err()
}

// isRatio reports whether unit is a ratio ("first/bare"), rather than a
// cost per operation ("ns/op", "B/op", "bare-ns/call") or a rate
// ("swept-rows/s").
func isRatio(unit string) bool {
	left, right, ok := strings.Cut(unit, "/")
	return ok && right != "op" && right != "call" && right != "s" && !strings.HasSuffix(left, "ns") && !strings.HasSuffix(left, "sec")
}

func median(vs []float64) float64 {
	s := slices.Sorted(slices.Values(vs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
