// Package tbtest is a testing.TB that keeps what a test helper reports, so
// that a test can assert the helper's failure text: the tests of idemtest
// and idemconnecttest run the kit against broken handlers through it.
package tbtest

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// Recorder is a testing.TB that keeps the failures and logs reported to it,
// and the cleanups registered with it, until End; the rest goes to the
// real test it embeds. Fatalf records, then panics with Fatal.
type Recorder struct {
	testing.TB
	mu       sync.Mutex
	failures []string
	logs     []string
	cleanups []func()
}

// Fatal is the panic of Recorder.Fatalf.
type Fatal struct{}

// New returns a Recorder in front of t.
func New(t testing.TB) *Recorder { return &Recorder{TB: t} }

func (r *Recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

func (r *Recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	panic(Fatal{})
}

func (r *Recorder) Logf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
}

func (r *Recorder) Cleanup(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cleanups = append(r.cleanups, f)
}

// Failures is what was reported as failures so far, a line each.
func (r *Recorder) Failures() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.failures, "\n")
}

// Logs is what was logged so far.
func (r *Recorder) Logs() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.logs, "\n")
}

// End runs the cleanups, as the end of a test does, shows the logs and
// failures on the real test's log (go test -v), and returns the failures.
func (r *Recorder) End() string {
	r.TB.Helper()
	r.mu.Lock()
	cleanups := r.cleanups
	r.cleanups = nil
	r.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	for _, l := range strings.Split(r.Logs(), "\n") {
		if l != "" {
			r.TB.Logf("logged: %s", l)
		}
	}
	failures := r.Failures()
	if failures != "" {
		r.TB.Logf("failed the test:\n%s", failures)
	}
	return failures
}

// WantPass fails t if anything was reported to r as a failure.
func WantPass(t testing.TB, r *Recorder) {
	t.Helper()
	if got := r.End(); got != "" {
		t.Errorf("the helper failed a correct test:\n%s", got)
	}
}

// WantFailure fails t unless a failure was reported to r, and it holds
// every one of words.
func WantFailure(t testing.TB, r *Recorder, words ...string) {
	t.Helper()
	got := r.End()
	if got == "" {
		t.Fatalf("the helper passed; want a failure that says %q", words)
	}
	for _, w := range words {
		if !strings.Contains(got, w) {
			t.Errorf("the failure does not say %q:\n%s", w, got)
		}
	}
}
