package engine

import (
	"testing"
	"time"

	"github.com/idemkey/idemkey/store/memory"
)

// TestFirstSent checks what a call that tells when it was first sent gets,
// in either mode: refused when that lies beyond the retention and its key
// has no record, replayed when it has one, run when it is recent, and
// refused as invalid when it lies in the future.
func TestFirstSent(t *testing.T) {
	const retention, skew = time.Hour, time.Minute
	at := func(age time.Duration) request {
		r := req
		r.FirstSent = time.Now().Add(-age)
		return r
	}
	for _, mode := range []string{"two-phase", "atomic"} {
		t.Run(mode, func(t *testing.T) {
			h := newHarness(t, WithRetention(retention), WithClockSkew(skew))
			op := h.op
			if mode == "atomic" {
				op = h.atomic
			}
			for _, tc := range []struct {
				name string
				age  time.Duration
				want Verdict
			}{
				{"older than the retention", retention + time.Second, Expired},
				{"within the skew of the retention", retention - skew/2, Expired},
				{"in the future beyond the skew", -2 * skew, FirstSentInvalid},
			} {
				if c := h.start(t.Context(), op, at(tc.age)); c.Verdict != tc.want {
					t.Errorf("first sent %s: verdict %v, want %v", tc.name, c.Verdict, tc.want)
				}
			}
			// The refusals left the key free (executed fails the test
			// otherwise): a recent call runs, and a stale retry of it then
			// replays.
			c := h.executed(t, op, at(retention-2*skew))
			if err := c.record(t.Context(), []byte("reply"), true); err != nil {
				t.Fatalf("Record: %v", err)
			}
			if c := h.start(t.Context(), op, at(2*retention)); c.Verdict != Replayed || string(c.Outcome) != "reply" {
				t.Errorf("a stale retry of a recorded key: verdict %v with %q, want replayed", c.Verdict, c.Outcome)
			}
		})
	}
}

// TestExpires checks that every answer about a key tells the same expiry,
// its record's creation plus the retention, on a real store.
func TestExpires(t *testing.T) {
	e := mustEngine(t, memory.New(), WithRetention(time.Hour))
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	first := e.newCall(op)
	first.start(t.Context(), req)
	if first.Verdict != Executed {
		t.Fatalf("first call: %v", first.Verdict)
	}
	exp := first.Expires
	if exp.Before(before.Add(time.Hour)) || exp.After(time.Now().Add(time.Hour)) {
		t.Fatalf("first call: Expires %v, want its start plus an hour", exp)
	}
	dup := e.newCall(op)
	dup.start(t.Context(), other) // another request: answered at once
	if dup.Verdict != Reused || !dup.Expires.Equal(exp) {
		t.Errorf("reused key: %v, Expires %v; want %v", dup.Verdict, dup.Expires, exp)
	}
	if err := first.record(t.Context(), []byte("reply"), true); err != nil {
		t.Fatal(err)
	}
	for _, retried := range []bool{false, true} { // by Reserve, and by Find
		r := req
		r.Retried = retried
		replay := e.newCall(op)
		replay.start(t.Context(), r)
		if replay.Verdict != Replayed || !replay.Expires.Equal(exp) {
			t.Errorf("replay (retried %v): %v, Expires %v; want replayed, %v", retried, replay.Verdict, replay.Expires, exp)
		}
	}
}
