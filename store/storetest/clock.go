package storetest

import (
	"sync"
	"testing"
	"time"
)

// Clock is a manual clock for stores that take one, such as memory.WithClock.
// It starts at a fixed instant and moves only when told to.
type Clock struct {
	mu  sync.Mutex
	now time.Time
}

// NewClock returns a Clock set to 2026-01-01T00:00:00Z.
func NewClock() *Clock { return &Clock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock forward by d; its signature fits Harness.Advance.
func (c *Clock) Advance(_ *testing.T, d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
