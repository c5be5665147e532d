package store

import (
	"context"
	"time"
)

// Pause waits d, or reports false if ctx ends, or would, within d: a retry
// loop gives up rather than start an attempt it cannot finish.
func Pause(ctx context.Context, d time.Duration) bool {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= d {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
