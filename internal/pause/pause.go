// Package pause waits between the attempts of a store's retry loop.
package pause

import (
	"context"
	"time"
)

// For waits d, and reports false if ctx ends first, or would within d, so
// that a retry loop gives up rather than start an attempt it cannot finish.
func For(ctx context.Context, d time.Duration) bool {
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
