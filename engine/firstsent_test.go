package engine

import (
	"strings"
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

// TestOperationRetention checks that an operation's own retention
// (OperationSpec.Retention) sets its keys' expiry and the refusal of a stale
// retry, beside another operation on the engine's, and that Operation
// refuses one shorter than the longest lease.
func TestOperationRetention(t *testing.T) {
	const month, hour = 31 * 24 * time.Hour, time.Hour
	e := mustEngine(t, memory.New(), WithRetention(hour), WithClockSkew(time.Minute))
	long, err := e.Operation(OperationSpec{Name: "/payments.v1.Payments/CreateCharge", Retention: month})
	if err != nil {
		t.Fatal(err)
	}
	short, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	if long.Retention() != month || short.Retention() != hour {
		t.Fatalf("retentions %v and %v, want %v and the engine's %v", long.Retention(), short.Retention(), month, hour)
	}
	before := time.Now()
	for _, tc := range []struct {
		op        *Operation
		retention time.Duration
	}{{long, month}, {short, hour}} {
		c := e.newCall(tc.op)
		c.start(t.Context(), req)
		if c.Verdict != Executed || c.Expires.Before(before.Add(tc.retention)) || c.Expires.After(time.Now().Add(tc.retention)) {
			t.Errorf("%s: %v, Expires %v; want executed, its start plus %v", tc.op.Name(), c.Verdict, c.Expires, tc.retention)
		}
	}
	stale := req
	stale.Key, stale.FirstSent = "key-first-sent-two-days-ago", time.Now().Add(-48*time.Hour)
	for _, tc := range []struct {
		op   *Operation
		want Verdict
	}{{long, Executed}, {short, Expired}} {
		c := e.newCall(tc.op)
		c.start(t.Context(), stale)
		if c.Verdict != tc.want {
			t.Errorf("%s: a retry first sent two days ago, kept %v: %v, want %v", tc.op.Name(), tc.op.Retention(), c.Verdict, tc.want)
		}
	}
	if _, err := e.Operation(OperationSpec{Name: opName, Retention: time.Second}); err == nil || !strings.Contains(err.Error(), "engine.WithMaxLease") {
		t.Errorf("a retention shorter than the longest lease: %v, want a refusal naming engine.WithMaxLease", err)
	}
}
