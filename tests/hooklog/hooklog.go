// Package hooklog is an application's consumer hooks for the brokers'
// tests: it keeps each event as a line, and panics when told to.
package hooklog

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
)

// Log keeps each event as "hook verdict action tenant/key size", then
// panics if Panics is set. Its zero value is ready.
type Log struct {
	Panics atomic.Bool

	mu     sync.Mutex
	events []string
}

// Hooks are the hooks to give consumer.WithHooks.
func (h *Log) Hooks() consumer.Hooks {
	keep := func(hook string) func(context.Context, engine.Event) {
		return func(_ context.Context, ev engine.Event) {
			h.mu.Lock()
			h.events = append(h.events, fmt.Sprintf("%s %s %s %s/%s %d", hook, ev.Verdict, consumer.Action(ev.Code), ev.Tenant, ev.Key, ev.Size))
			h.mu.Unlock()
			if h.Panics.Load() {
				panic("audit failed for " + ev.Tenant + "/" + ev.Key)
			}
		}
	}
	return consumer.Hooks{OnExecute: keep("execute"), OnReplay: keep("replay"), OnRefuse: keep("refuse")}
}

// Want checks the events kept since the last Want, in order, and forgets
// them.
func (h *Log) Want(t *testing.T, want ...string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if strings.Join(h.events, "\n") != strings.Join(want, "\n") {
		t.Errorf("hooks ran:\n\t%s\nwant:\n\t%s", strings.Join(h.events, "\n\t"), strings.Join(want, "\n\t"))
	}
	h.events = nil
}
