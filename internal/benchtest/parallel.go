package benchtest

import (
	"bufio"
	"bytes"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Parallel runs call from goroutines goroutines at once until b is done
// (b.RunParallel), each with its own number from 0, and reports the calls
// per second, the process's CPU per call ("cpu-ns/op") and, if the mutex
// profile is on (go test -mutexprofile), the share of the goroutines' time
// spent waiting for a lock released in a function whose name contains
// within ("lock-wait-%"), as the profile counts it.
func Parallel(b *testing.B, goroutines int, within string, call func(g int) func()) {
	b.Helper()
	procs := runtime.GOMAXPROCS(0)
	b.SetParallelism((goroutines + procs - 1) / procs)
	profiled := runtime.SetMutexProfileFraction(-1) > 0
	var wait0 time.Duration
	if profiled {
		wait0 = lockWait(within)
	}
	next := make(chan int, goroutines*procs)
	for g := range cap(next) {
		next <- g
	}
	cpu0, start := cpuTime(), time.Now()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		f := call(<-next)
		for pb.Next() {
			f()
		}
	})
	b.StopTimer()
	wall := time.Since(start)
	b.ReportMetric(float64(b.N)/wall.Seconds(), "calls/s")
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
	if profiled {
		b.ReportMetric(100*(lockWait(within)-wait0).Seconds()/(float64(goroutines)*wall.Seconds()), "lock-wait-%")
	}
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
