// Package hooklog is an application's consumer hooks for the tests of the
// consumer and of the brokers' adapters: it keeps each event as a line, and
// panics when told to.
package hooklog

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
)

// Log keeps each event as "hook verdict action tenant/key size", then
// panics if Panics is set. An event of another operation than Operation
// (if set), or an execution whose Recorded disagrees with its Size, has
// the line end with what is wrong. Its zero value is ready.
type Log struct {
	Panics    atomic.Bool
	Operation string

	mu     sync.Mutex
	events []string
}

// Hooks are the hooks to give engine.WithHooks, for a consumer's engine.
func (h *Log) Hooks() engine.Hooks {
	keep := func(hook string) func(context.Context, engine.Event) {
		return func(_ context.Context, ev engine.Event) {
			h.mu.Lock()
			e := fmt.Sprintf("%s %s %s %s/%s %d", hook, ev.Verdict, consumer.Action(ev.Code), ev.Tenant, ev.Key, ev.Size)
			if (h.Operation != "" && ev.Operation != h.Operation) || (ev.Verdict == engine.Executed && ev.Recorded != (ev.Size > 0)) {
				e += fmt.Sprintf(" (operation %q, recorded %v)", ev.Operation, ev.Recorded)
			}
			h.events = append(h.events, e)
			h.mu.Unlock()
			if h.Panics.Load() {
				panic("audit failed for " + ev.Tenant + "/" + ev.Key)
			}
		}
	}
	return engine.Hooks{OnExecute: keep("execute"), OnReplay: keep("replay"), OnRefuse: keep("refuse")}
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

// Events are the events kept since the last Want, in order.
func (h *Log) Events() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.events)
}
