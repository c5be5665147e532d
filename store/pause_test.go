package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Pause waits out d; it gives up at once when ctx's deadline comes within
// d, and as soon as ctx is cancelled.
func TestPause(t *testing.T) {
	start := time.Now()
	if !store.Pause(context.Background(), 10*time.Millisecond) || time.Since(start) < 10*time.Millisecond {
		t.Error("Pause(10ms) did not wait 10ms and report true")
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start = time.Now()
	if store.Pause(ctx, time.Hour) || time.Since(start) > time.Second {
		t.Error("Pause(1h) with a deadline a minute away waited, or reported true")
	}

	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(10*time.Millisecond, cancel)
	start = time.Now()
	if store.Pause(ctx, time.Minute) || time.Since(start) > 10*time.Second {
		t.Error("Pause(1m) went on after its context was cancelled")
	}
}
