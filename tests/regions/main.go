// Command regions simulates idempotency keys across three regions and prints,
// for each design and replication lag, the double executions, the refusals
// and the availability, with every region up and with region c down for two
// minutes: make regions. It is a discrete-event simulation on virtual time,
// so a seed gives one table, in seconds. docs/regions.md reads the table.
//
// Each region's store follows the contract of store/store.go (reserve under
// a lease and a fencing token, then complete; a record past its lease taken
// over by the same request), modelled in store.go and checked against
// store/memory on the same virtual clock (TestModelIsMemory); the engine's
// request path is modelled in serve. The model's limits are in
// docs/regions.md.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

func main() {
	seed := flag.Uint64("seed", 1, "the random seed: one seed, one table")
	ops := flag.Int("ops", 20000, "operations per run, each with a key of its own")
	lags := flag.String("lags", "0,50ms,200ms,1s,5s", "the replication lags, comma-separated")
	flag.Parse()
	var ls []time.Duration
	for _, f := range strings.Split(*lags, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(f))
		if err != nil || d < 0 {
			fmt.Fprintf(os.Stderr, "regions: -lags: %q is not a duration of 0 or more\n", f)
			os.Exit(2)
		}
		ls = append(ls, d)
	}
	if *ops < 1 {
		fmt.Fprintln(os.Stderr, "regions: -ops must be at least 1")
		os.Exit(2)
	}
	table(os.Stdout, config{seed: *seed, ops: *ops}, ls)
}

// row is one design at one lag, with every region up and with one down.
type row struct {
	d        design
	lag      time.Duration
	up, down result
}

// grid runs every design at every lag, in both worlds; a design that does
// not replicate asynchronously, at the first lag only.
func grid(c config, lags []time.Duration) []row {
	var rows []row
	for _, d := range designs {
		for i, lag := range lags {
			if i > 0 && !d.replicates() {
				break // one row: the lag is not the design's
			}
			c.lag = lag
			up := c
			down := c
			down.down = true
			rows = append(rows, row{d: d, lag: lag, up: run(up, d), down: run(down, d)})
		}
	}
	return rows
}

// table prints grid's rows as two Markdown tables, every region up and
// region c down, with the world's settings.
func table(w io.Writer, c config, lags []time.Duration) {
	c = c.defaults()
	fmt.Fprintf(w, "seed %d: %d operations over %v, 3 regions (a, b, c); one way %v to the client's nearest region, %v to another and between regions;\n",
		c.seed, c.ops, c.span, c.near, c.far)
	fmt.Fprintf(w, "each attempt's deadline %v, lease %v, %d attempts or %v at most; %.0f%% of replies lost; %.0f%% of retries fail over\n",
		c.deadline, c.lease, c.maxAttempts, c.budget, 100*c.lossRate, 100*c.failoverRate)
	rows := grid(c, lags)
	for _, down := range []bool{false, true} {
		if down {
			fmt.Fprintf(w, "\nRegion c down from %v for %v:\n\n", c.downAt, c.downFor)
		} else {
			fmt.Fprint(w, "\nEvery region up:\n\n")
		}
		fmt.Fprintln(w, "| design | lag | double executions | refusals | available | not completed | p50 | p99 |")
		fmt.Fprintln(w, "|---|---|--:|--:|--:|--:|--:|--:|")
		for _, r := range rows {
			res := r.up
			if down {
				res = r.down
			}
			lag := r.lag.String()
			if !r.d.replicates() {
				lag = "-"
			}
			fmt.Fprintf(w, "| %s | %s | %d | %d | %.2f%% | %d | %s | %s |\n", r.d.name, lag,
				res.doubles, res.refusals, 100*res.availability(), res.ops-res.completed, ms(res.p50), ms(res.p99))
		}
	}
}

func ms(d time.Duration) string { return fmt.Sprintf("%d ms", d.Milliseconds()) }
