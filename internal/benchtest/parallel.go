//go:build unix

package benchtest

import (
	"bufio"
	"bytes"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// ParallelOp is one kind of operation of InterleaveParallel.
type ParallelOp struct {
	Name string
	// Within names the functions whose lock waits lock-wait-% counts.
	Within string
	// New returns goroutine g's call, which InterleaveParallel calls with
	// 0, 1, 2 and so on.
	New func(g int) func(i int) error
}

// ParallelStats is what InterleaveParallel measured of one op.
type ParallelStats struct {
	CallsPerSecond float64
	CPUPerCall     time.Duration
}

// InterleaveParallel runs ops in turn, as Interleave does, each from
// goroutines goroutines at once making chunk calls each, until b is done.
// It reports each op's calls per second ("<name>-calls/s"), the process's
// CPU ("<name>-cpu-ns/op") and allocations ("<name>-allocs/op") per call,
// and, if the mutex profile is on, the share of the goroutines' time spent
// waiting for a lock released in a function whose name contains its Within
// ("<name>-lock-wait-%"); it returns the first two.
func InterleaveParallel(b *testing.B, goroutines, chunk int, ops ...ParallelOp) []ParallelStats {
	b.Helper()
	calls := make([][]func(int) error, len(ops))
	for k, op := range ops {
		for g := range goroutines {
			calls[k] = append(calls[k], op.New(g))
		}
	}
	profiled := runtime.SetMutexProfileFraction(-1) > 0
	type spent struct {
		wall, cpu, wait time.Duration
		allocs          uint64
	}
	spents := make([]spent, len(ops))
	n := 0
	for b.Loop() {
		for j := range ops {
			k := (n + j) % len(ops)
			var wait0 time.Duration
			if profiled {
				wait0 = lockWait(ops[k].Within)
			}
			var wg sync.WaitGroup
			cpu0, allocs0, start := cpuTime(), allocs(), time.Now()
			for g := range goroutines {
				wg.Go(func() {
					for i := n * chunk; i < (n+1)*chunk; i++ {
						if err := calls[k][g](i); err != nil {
							b.Errorf("%s: %v", ops[k].Name, err)
							return
						}
					}
				})
			}
			wg.Wait()
			s := &spents[k]
			s.wall += time.Since(start)
			s.cpu += cpuTime() - cpu0
			s.allocs += allocs() - allocs0
			if profiled {
				s.wait += lockWait(ops[k].Within) - wait0
			}
		}
		n++
	}
	stats := make([]ParallelStats, len(ops))
	for k, op := range ops {
		s, calls := spents[k], float64(n*chunk*goroutines)
		stats[k] = ParallelStats{CallsPerSecond: calls / s.wall.Seconds(), CPUPerCall: time.Duration(float64(s.cpu) / calls)}
		b.ReportMetric(stats[k].CallsPerSecond, op.Name+"-calls/s")
		b.ReportMetric(float64(stats[k].CPUPerCall), op.Name+"-cpu-ns/op")
		b.ReportMetric(float64(s.allocs)/calls, op.Name+"-allocs/op")
		if profiled {
			b.ReportMetric(100*s.wait.Seconds()/(float64(goroutines)*s.wall.Seconds()), op.Name+"-lock-wait-%")
		}
	}
	return stats
}

// allocs is how many heap objects the process has allocated so far.
func allocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// cpuTime is the process's CPU time so far, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// lockWait is how long goroutines have waited so far, as the mutex profile
// counts it, for the locks released in a function whose name contains
// within.
func lockWait(within string) time.Duration {
	var buf bytes.Buffer
	if err := pprof.Lookup("mutex").WriteTo(&buf, 1); err != nil {
		return 0
	}
	var perSecond, cycles, total float64
	match := false
	flush := func() {
		if match && perSecond > 0 {
			total += cycles / perSecond
		}
		cycles, match = 0, false
	}
	sc := bufio.NewScanner(&buf)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "cycles/second="):
			perSecond, _ = strconv.ParseFloat(strings.TrimPrefix(line, "cycles/second="), 64)
		case strings.HasPrefix(line, "#"):
			match = match || strings.Contains(line, within)
		case strings.Contains(line, " @ "):
			flush()
			cycles, _ = strconv.ParseFloat(strings.Fields(line)[0], 64)
		}
	}
	flush()
	return time.Duration(total * float64(time.Second))
}
