// Command benchtable prints the ratios that benchmarks report (units such as
// "first/bare"), from one `go test -bench -count=N` output, as one Markdown
// table: per benchmark and ratio, the median of the N runs and their range.
// make bench runs it on bin/bench.txt.
//
//	go run ./internal/benchtable bin/bench.txt
package main

import (
	"fmt"
	"os"
	"slices"

	"github.com/idemkey/idemkey/tests/benchfile"
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
	metrics, err := benchfile.Parse(f)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("| benchmark | ratio | median | range | runs |")
	fmt.Println("|---|---|---|---|---|")
	for _, m := range metrics {
		if benchfile.IsRatio(m.Unit) {
			fmt.Printf("| %s | %s | %.3f | %.3f–%.3f | %d |\n", m.Bench, m.Unit, benchfile.Median(m.Values), slices.Min(m.Values), slices.Max(m.Values), len(m.Values))
		}
	}
}
