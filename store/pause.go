package store

import (
	"context"
	"time"
)

// Pause waits d between the attempts of a retry loop, and reports false if
// ctx ends first, or would within d, so that the loop gives up rather than
// start an attempt it cannot finish. The stores' retry loops use it
// (store/postgres, store/redis), and so does package consumer between a
// message's attempts: it is exported, rather than internal, because
// store/redis is a module of its own, which imports none of the core's
// internal packages (scripts/check-deps).
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
