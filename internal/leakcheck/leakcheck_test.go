package leakcheck

import (
	"os"
	"os/signal"
	"strings"
	"testing"
	"time"
)

// The package checks itself: its tests leave no goroutine running.
func TestMain(m *testing.M) { Main(m) }

// blockOn is a goroutine that runs until ch is closed.
func blockOn(ch chan struct{}) { <-ch }

// A goroutine blocked on a channel is found, by its function, until the
// channel is closed.
func TestFind(t *testing.T) {
	ch := make(chan struct{})
	go blockOn(ch)
	leaks := find(100 * time.Millisecond)
	close(ch)
	if len(leaks) != 1 || !strings.Contains(leaks[0], "leakcheck.blockOn(") {
		t.Errorf("found %d goroutines, want the one in blockOn:\n%s", len(leaks), strings.Join(leaks, "\n\n"))
	}
	if leaks := find(timeout); len(leaks) > 0 {
		t.Errorf("found %d goroutines after blockOn returned:\n%s", len(leaks), strings.Join(leaks, "\n\n"))
	}
}

// The goroutines of the testing package and os/signal, which runs one for
// good once signal.Notify is called, are not leaks.
func TestIgnored(t *testing.T) {
	c := make(chan os.Signal, 1)
	signal.Notify(c, os.Interrupt)
	signal.Stop(c)
	if leaks := find(0); len(leaks) > 0 {
		t.Errorf("found %d goroutines, want none:\n%s", len(leaks), strings.Join(leaks, "\n\n"))
	}
}
