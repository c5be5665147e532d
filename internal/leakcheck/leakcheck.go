// Package leakcheck fails a package's tests if they leave goroutines
// running. It does what go.uber.org/goleak's VerifyTestMain does, with the
// standard library only, so that our modules do not require goleak:
//
//	func TestMain(m *testing.M) { leakcheck.Main(m) }
package leakcheck

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// timeout bounds how long Main waits for the tests' goroutines to exit. It
// is reached only when one really leaked, so it is generous, for a busy
// machine.
const timeout = 10 * time.Second

// Main runs the tests, then the cleanups in order, then waits for the
// goroutines the tests started to exit, and exits with m.Run's code. If some
// are still running after a while, it prints their stacks to standard error
// and exits with 1, or with m.Run's code if the tests failed already.
func Main(m *testing.M, cleanup ...func()) {
	code := m.Run()
	for _, f := range cleanup {
		f()
	}
	if leaks := find(timeout); len(leaks) > 0 {
		fmt.Fprintf(os.Stderr, "leakcheck: %d goroutine(s) still running %v after the tests ended:\n\n%s\n",
			len(leaks), timeout, strings.Join(leaks, "\n\n"))
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// find returns the stacks of the goroutines running but the caller's and the
// ignored ones, looking again, with growing pauses, until there are none or
// timeout has passed.
func find(timeout time.Duration) []string {
	deadline := time.Now().Add(timeout)
	for pause := time.Millisecond; ; pause = min(2*pause, 100*time.Millisecond) {
		var leaks []string
		for _, s := range stacks()[1:] { // the first is the caller's
			if !ignored(s) {
				leaks = append(leaks, s)
			}
		}
		if len(leaks) == 0 || time.Now().After(deadline) {
			return leaks
		}
		time.Sleep(pause)
	}
}

// stacks returns the stacks of all goroutines, the caller's first, each
// starting with its header line, such as "goroutine 7 [chan receive]:".
func stacks() []string {
	for n := 64 << 10; ; n *= 2 {
		buf := make([]byte, n)
		if k := runtime.Stack(buf, true); k < n {
			return strings.Split(strings.TrimSpace(string(buf[:k])), "\n\n")
		}
	}
}

// ignoredFuncs are functions of the testing package, the runtime, and the
// standard library whose goroutines are not the tests' own: the testing
// main goroutine, a test's goroutine returning, fuzzing, os/signal's loop
// and go test -trace. This is the intent of goleak's default filters. One
// more is a dependency's, started by a package's init.
var ignoredFuncs = []string{
	"testing.(*M).", "testing.tRunner", "testing.runFuzzing", "testing.runFuzzTests", "internal/fuzz.",
	"os/signal.signal_recv", "os/signal.loop", "runtime.ensureSigM",
	"runtime/trace.", "runtime.ReadTrace",
	// OpenCensus's view worker, started by its package's init for the
	// process's life: the Cloud Spanner client imports it (example/server).
	"go.opencensus.io/stats/view.(*worker).start",
}

// ignored reports whether stack s is of a goroutine that is not a leak: one
// with a function of ignoredFuncs on it, or whose functions are all in
// package runtime.
func ignored(s string) bool {
	allRuntime := true
	for _, line := range strings.Split(s, "\n")[1:] {
		if strings.HasPrefix(line, "created by ") {
			break // the creator ran on another goroutine
		}
		if line == "" || line[0] == '\t' || strings.HasPrefix(line, "...") {
			continue // a file and line, or "...N frames elided..."
		}
		for _, f := range ignoredFuncs {
			if strings.HasPrefix(line, f) {
				return true
			}
		}
		allRuntime = allRuntime && strings.HasPrefix(line, "runtime.")
	}
	return allRuntime
}
