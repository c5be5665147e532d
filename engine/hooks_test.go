package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/idemkey/idemkey/store"
)

// hookLog is Hooks that note every event, under the hook's name.
type hookLog struct {
	mu     sync.Mutex
	events []string
	last   Event
}

func (l *hookLog) hooks() Hooks {
	note := func(name string) func(context.Context, Event) {
		return func(_ context.Context, ev Event) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.events = append(l.events, name+" "+ev.Verdict.String())
			l.last = ev
		}
	}
	return Hooks{OnExecute: note("execute"), OnReplay: note("replay"), OnRefuse: note("refuse")}
}

func (l *hookLog) take() ([]string, Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	events, last := l.events, l.last
	l.events, l.last = nil, Event{}
	return events, last
}

// want checks that the calls since the last check ran exactly the hooks of
// want, and that the last had the event ev.
func (l *hookLog) want(t *testing.T, ev Event, want ...string) {
	t.Helper()
	got, last := l.take()
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("hooks ran: %q, want %q", got, want)
	}
	if last != ev {
		t.Errorf("last event %+v, want %+v", last, ev)
	}
}

// TestHooks runs a call to each verdict and checks the one hook it runs,
// and what the hook is told.
func TestHooks(t *testing.T) {
	full := fmt.Errorf("fake store: %w", store.ErrFull)
	ev := func(v Verdict, code, size int, recorded bool) Event {
		return Event{Operation: opName, Tenant: req.Tenant, Key: req.Key, Verdict: v, Code: code, Size: size, Recorded: recorded}
	}
	tests := []struct {
		name   string
		opts   []Option
		atomic bool
		run    func(t *testing.T, h *harness, c *call) // after start, before end
		before func(h *harness)                        // before start
		want   Event
		hook   string
	}{
		{
			name: "executed and recorded",
			run: func(t *testing.T, h *harness, c *call) {
				if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
					t.Fatal(err)
				}
			},
			want: ev(Executed, 0, len("outcome-1"), true), hook: "execute executed",
		},
		{
			name: "executed and released",
			run:  func(t *testing.T, h *harness, c *call) { c.release(t.Context()) },
			want: ev(Executed, 14, 0, false), hook: "execute executed",
		},
		{
			name:   "executed in atomic mode",
			atomic: true,
			run: func(t *testing.T, h *harness, c *call) {
				if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
					t.Fatal(err)
				}
			},
			want: ev(Executed, 0, len("outcome-1"), true), hook: "execute executed",
		},
		{
			name:   "executed in atomic mode, and the commit failed",
			atomic: true,
			run: func(t *testing.T, h *harness, c *call) {
				h.st.fail(mCommit, errDown, 1)
				if err := c.record(t.Context(), []byte("outcome-1"), true); err == nil {
					t.Fatal("Record: nil, want the commit's error")
				}
			},
			want: ev(Executed, 14, 0, false), hook: "execute executed",
		},
		{
			name:   "executed in atomic mode, and another call recorded the key first",
			atomic: true,
			run: func(t *testing.T, h *harness, c *call) {
				h.st.fail(mCommit, fmt.Errorf("fake store: %w", store.ErrLeaseLost), 1)
				if err := c.record(t.Context(), []byte("outcome-1"), true); !errors.Is(err, errSuperseded) {
					t.Fatalf("Record: %v, want errSuperseded", err)
				}
			},
			// Its writes were rolled back, and it answers with the other
			// call's record: a replay, not a second execution.
			want: ev(Replayed, 0, len(otherOutcome), false), hook: "replay replayed",
		},
		{
			name: "executed, and the reply took a short error's place",
			opts: []Option{WithMaxRecordSize(1024)},
			run: func(t *testing.T, h *harness, c *call) {
				if err := c.record(t.Context(), make([]byte, 2048), true); !errors.Is(err, ErrTooLarge) {
					t.Fatalf("Record: %v, want ErrTooLarge", err)
				}
				if err := c.record(t.Context(), []byte("too large"), false); err != nil {
					t.Fatal(err)
				}
			},
			want: ev(Executed, 13, len("too large"), true), hook: "execute executed",
		},
		{
			name: "executed, and the store had no room",
			run: func(t *testing.T, h *harness, c *call) {
				h.st.fail(mComplete, full, forever)
				_ = c.record(t.Context(), []byte("outcome-1"), true)
				_ = c.record(t.Context(), []byte("no room"), false)
			},
			want: ev(Executed, 13, 0, false), hook: "execute executed",
		},
		{
			name: "executed, and the record is written in the background",
			run: func(t *testing.T, h *harness, c *call) {
				h.st.fail(mComplete, errDown, 1)
				if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
					t.Fatal(err)
				}
				eventually(t, "the record, written in the background", func() bool { return h.st.count(mComplete) == 2 })
			},
			want: ev(Executed, 0, len("outcome-1"), true), hook: "execute executed",
		},
		{
			name: "executed, and the lease was lost",
			run: func(t *testing.T, h *harness, c *call) {
				h.st.fail(mComplete, fmt.Errorf("fake store: %w", store.ErrLeaseLost), 1)
				_ = c.record(t.Context(), []byte("outcome-1"), true)
			},
			want: ev(Executed, 0, 0, false), hook: "execute executed",
		},
		{
			name: "replayed",
			before: func(h *harness) {
				c := h.e.newCall(h.op)
				c.start(context.Background(), req)
				_ = c.record(context.Background(), []byte("outcome-1"), true)
			},
			want: ev(Replayed, 0, len("outcome-1"), false), hook: "replay replayed",
		},
		{
			name: "reused",
			before: func(h *harness) {
				c := h.e.newCall(h.op)
				c.start(context.Background(), other)
				_ = c.record(context.Background(), []byte("outcome-1"), true)
			},
			want: ev(Reused, 3, 0, false), hook: "refuse reused",
		},
		{
			name: "in progress",
			opts: []Option{WithInProgressWait(0)},
			before: func(h *harness) {
				c := h.e.newCall(h.op)
				c.start(context.Background(), req)
			},
			want: ev(InProgress, 10, 0, false), hook: "refuse in_progress",
		},
		{
			name:   "store unavailable",
			before: func(h *harness) { h.st.fail(mReserve, errDown, forever) },
			want:   ev(StoreUnavailable, 14, 0, false), hook: "refuse store_unavailable",
		},
		{
			name:   "store full",
			before: func(h *harness) { h.st.fail(mReserve, full, forever) },
			want:   ev(StoreFull, 8, 0, false), hook: "refuse store_full",
		},
		{
			name:   "failed open",
			opts:   []Option{WithFailOpen()},
			before: func(h *harness) { h.st.fail(mReserve, errDown, forever) },
			want:   ev(FailedOpen, 0, 0, false), hook: "execute failed_open",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var hooks hookLog
			h := newHarness(t, append([]Option{WithHooks(hooks.hooks())}, tc.opts...)...)
			op := h.op
			if tc.atomic {
				op = h.atomic
			}
			if tc.before != nil {
				tc.before(h)
				hooks.take() // the calls of before ended none
			}
			c := h.start(t.Context(), op, req)
			if tc.run != nil {
				tc.run(t, h, c)
			}
			hooks.want(t, Event{}) // nothing before end
			c.end(t.Context(), tc.want.Code)
			hooks.want(t, tc.want, tc.hook)
		})
	}

	// call.read sets the verdicts of calls answered before start: it read
	// no key, or no valid one, or refused the tenant or the request.
	for _, v := range []Verdict{NoKey, KeyMissing, KeyInvalid, Refused} {
		t.Run(v.String(), func(t *testing.T) {
			var hooks hookLog
			h := newHarness(t, WithHooks(hooks.hooks()))
			c := h.e.newCall(h.op)
			if v != Refused {
				c.Verdict = v // Refused is the verdict of a call that never started
			}
			c.end(t.Context(), 3)
			hook := "refuse "
			if v == NoKey {
				hook = "execute "
			}
			hooks.want(t, Event{Operation: opName, Verdict: v, Code: 3}, hook+v.String())
		})
	}
}

// TestHooksOnRetries: one business operation retried n times reports one
// execution and n-1 replays, however its retries arrive.
func TestHooksOnRetries(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprintf("atomic=%v", atomic), func(t *testing.T) {
			var hooks hookLog
			h := newHarness(t, WithHooks(hooks.hooks()))
			op := h.op
			if atomic {
				op = h.atomic
			}
			const n = 5
			for i := range n {
				c := h.e.newCall(op)
				c.start(t.Context(), request{Tenant: req.Tenant, Key: req.Key, Fingerprint: req.Fingerprint, Retried: i > 0})
				if c.Verdict == Executed {
					if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
						t.Fatal(err)
					}
				}
				c.end(t.Context(), 0)
			}
			got, _ := hooks.take()
			want := []string{"execute executed"}
			for range n - 1 {
				want = append(want, "replay replayed")
			}
			if strings.Join(got, ", ") != strings.Join(want, ", ") {
				t.Fatalf("hooks ran: %q, want %q", got, want)
			}
		})
	}
}

type ctxKey struct{}

// TestHookContext: a hook's context has the call's values but not its
// cancellation: a caller who hung up does not cancel the hook's work.
func TestHookContext(t *testing.T) {
	var got context.Context
	h := newHarness(t, WithHooks(Hooks{OnExecute: func(ctx context.Context, _ Event) { got = ctx }}))
	ctx, cancel := context.WithCancel(context.WithValue(t.Context(), ctxKey{}, "identity"))
	c := h.start(ctx, h.op, req)
	cancel() // the caller hangs up while the handler runs
	if err := c.record(ctx, []byte("outcome-1"), true); err != nil {
		t.Fatal(err)
	}
	c.end(ctx, 0)
	if got == nil {
		t.Fatal("the hook did not run")
	}
	if got.Value(ctxKey{}) != "identity" {
		t.Error("the hook's context lacks the call's values")
	}
	if got.Err() != nil {
		t.Errorf("the hook's context is done (%v): the caller's cancellation reached it", got.Err())
	}
	if _, ok := got.Deadline(); ok {
		t.Error("the hook's context has a deadline")
	}
}

// TestHookPanics: a hook that panics changes neither the call's record nor
// what the next call gets; the panic is logged at Error without the raw key
// or tenant, with the runtime's own words only.
func TestHookPanics(t *testing.T) {
	const rawKey, rawTenant = "KEY-marmot-5521", "TENANT-heron-0904"
	r := request{Tenant: rawTenant, Key: rawKey, Fingerprint: fingerprint("request-1")}
	var replays int
	h := newHarness(t, WithHooks(Hooks{
		OnExecute: func(_ context.Context, ev Event) {
			panic("audit failed for " + ev.Tenant + "/" + ev.Key)
		},
		OnReplay: func(_ context.Context, ev Event) {
			replays++
			var seen []string
			_ = seen[len(ev.Key)] // a runtime error
		},
		OnRefuse: func(_ context.Context, ev Event) {
			panic(fmt.Errorf("refused %s", ev.Key))
		},
	}))
	c := h.start(t.Context(), h.op, r)
	if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
		t.Fatal(err)
	}
	c.end(t.Context(), 0) // must not panic

	again := h.start(t.Context(), h.op, r)
	if again.Verdict != Replayed || string(again.Outcome) != "outcome-1" {
		t.Fatalf("after a panicking hook: verdict %v, outcome %q; want the record replayed", again.Verdict, again.Outcome)
	}
	again.end(t.Context(), 0)
	if replays != 1 {
		t.Errorf("OnReplay ran %d times, want 1", replays)
	}
	reused := h.start(t.Context(), h.op, request{Tenant: rawTenant, Key: rawKey, Fingerprint: fingerprint("request-2")})
	reused.end(t.Context(), 3)

	logs := h.logs.String()
	for _, want := range []string{
		"the OnExecute hook panicked", "the OnReplay hook panicked", "the OnRefuse hook panicked",
		"level=ERROR", "a panic with a value of type string", "a panic with a value of type *errors.errorString",
		"runtime error: index out of range", "stack=", "engine.TestHookPanics.func1", "hooks_test.go:", "scope=", opName,
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log holds no %q", want)
		}
	}
	for _, raw := range []string{rawKey, rawTenant} {
		if strings.Contains(logs, raw) {
			t.Errorf("the log holds the raw %q:\n%s", raw, logs)
		}
	}
}

// TestWithHooksReplaces: a later WithHooks replaces an earlier one whole,
// and empty Hooks run nothing.
func TestWithHooksReplaces(t *testing.T) {
	var first, second hookLog
	h := newHarness(t, WithHooks(first.hooks()), WithHooks(Hooks{OnReplay: second.hooks().OnReplay}))
	h.recorded(t, h.op, req, "outcome-1")
	c := h.start(t.Context(), h.op, req)
	c.end(t.Context(), 0)
	if got, _ := first.take(); len(got) != 0 {
		t.Errorf("the replaced hooks ran: %q", got)
	}
	if got, _ := second.take(); len(got) != 1 {
		t.Errorf("the later hooks ran %q, want one replay", got)
	}

	h = newHarness(t, WithHooks(first.hooks()), WithHooks(Hooks{}))
	c = h.start(t.Context(), h.op, req)
	c.end(t.Context(), 0)
	if got, _ := first.take(); len(got) != 0 {
		t.Errorf("hooks ran after WithHooks(Hooks{}): %q", got)
	}
}
