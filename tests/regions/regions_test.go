package main

import (
	"bytes"
	"testing"
	"time"
)

// testConfig is a smaller world than make regions', on a fixed seed.
var testConfig = config{seed: 1, ops: 5000}

var testLags = []time.Duration{0, 200 * time.Millisecond, time.Second, 5 * time.Second}

func byName(t *testing.T, name string) design {
	t.Helper()
	for _, d := range designs {
		if d.name == name {
			return d
		}
	}
	t.Fatalf("no design %q", name)
	return design{}
}

// TestRecommendedRunOnce: the fence, the quorum store, pinned keys and a
// home region run no key twice, at any lag, with every region up or one
// down, while every operation's client fails over at random.
func TestRecommendedRunOnce(t *testing.T) {
	for _, name := range []string{"fence", "quorum", "pinned", "home"} {
		d := byName(t, name)
		for _, lag := range testLags {
			for _, down := range []bool{false, true} {
				c := testConfig
				c.lag, c.down = lag, down
				res := run(c, d)
				if res.doubles != 0 {
					t.Errorf("%s, lag %v, region down %v: %d double executions, want 0", name, lag, down, res.doubles)
				}
				if res.executions < res.completed || res.completed == 0 {
					t.Errorf("%s, lag %v, region down %v: %d executions for %d completed operations", name, lag, down, res.executions, res.completed)
				}
			}
		}
	}
}

// TestFailoverOrders: what a reader of docs/regions.md is told, as counts
// and orders. Last writer wins runs keys twice, more at a larger lag, and
// none at 0; a fence whose bound is below the lag runs keys twice; the
// quorum store keeps every operation available with a region down, and
// pinned keys do not; the fence refuses more as the lag grows.
func TestFailoverOrders(t *testing.T) {
	runs := func(name string, down bool) []result {
		var rs []result
		for _, lag := range testLags {
			c := testConfig
			c.lag, c.down = lag, down
			rs = append(rs, run(c, byName(t, name)))
		}
		return rs
	}
	for _, down := range []bool{false, true} {
		l := runs("lww", down)
		if l[0].doubles != 0 {
			t.Errorf("lww, lag 0, region down %v: %d double executions, want 0", down, l[0].doubles)
		}
		for i := 1; i < len(l); i++ {
			if l[i].doubles < l[i-1].doubles {
				t.Errorf("lww, region down %v: %d double executions at lag %v, fewer than %d at %v", down, l[i].doubles, testLags[i], l[i-1].doubles, testLags[i-1])
			}
		}
		if last := l[len(l)-1]; last.doubles <= l[0].doubles {
			t.Errorf("lww, region down %v: %d double executions at lag %v, no more than %d at 0", down, last.doubles, testLags[len(l)-1], l[0].doubles)
		}
		f := runs("fence", down)
		if last := f[len(f)-1]; last.refusals <= f[0].refusals {
			t.Errorf("fence, region down %v: %d refusals at lag %v, no more than %d at 0", down, last.refusals, testLags[len(f)-1], f[0].refusals)
		}
	}
	c := testConfig
	c.lag = 5 * time.Second
	if res := run(c, byName(t, "fence 2s")); res.doubles == 0 {
		t.Errorf("fence 2s, lag 5s: no double executions; a bound below the lag should run keys first sent elsewhere")
	}
	c = testConfig
	c.down = true
	q, p := run(c, byName(t, "quorum")), run(c, byName(t, "pinned"))
	if q.completed != q.ops {
		t.Errorf("quorum, region c down: %d of %d operations completed, want all: a majority is up", q.completed, q.ops)
	}
	if p.completed >= q.completed {
		t.Errorf("pinned, region c down: %d operations completed, not fewer than quorum's %d", p.completed, q.completed)
	}
	c.down = false
	if q, h := run(c, byName(t, "quorum")), run(c, byName(t, "home")); q.p50 <= h.p50 {
		t.Errorf("quorum's median %v, not above home's %v: every write waits for a majority", q.p50, h.p50)
	}
}

// TestSameSeedSameTable: the simulation runs on virtual time alone.
func TestSameSeedSameTable(t *testing.T) {
	tableOf := func(seed uint64) string {
		var b bytes.Buffer
		table(&b, config{seed: seed, ops: 500}, testLags)
		return b.String()
	}
	if a, b := tableOf(3), tableOf(3); a != b {
		t.Errorf("seed 3 printed two tables:\n%s\n%s", a, b)
	}
	if tableOf(3) == tableOf(4) {
		t.Error("seeds 3 and 4 printed one table: the seed is not used")
	}
}
