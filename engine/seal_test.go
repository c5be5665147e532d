package engine

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
)

func newTestRing(t *testing.T, primary byte, previous ...byte) *seal.KeyRing {
	t.Helper()
	var opts []seal.Option
	for _, p := range previous {
		opts = append(opts, seal.WithPreviousKeys(bytes.Repeat([]byte{p}, seal.KeySize)))
	}
	r, err := seal.NewKeyRing(bytes.Repeat([]byte{primary}, seal.KeySize), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

var reqKey = store.ScopeKey(req.Tenant, opName, req.Key)

const secretReply = "card 4242424242424242, 1 Main St"

// wantNoRaw fails if the log holds the call's raw key or tenant.
func (h *harness) wantNoRaw(t *testing.T) {
	t.Helper()
	if logs := h.logs.String(); strings.Contains(logs, req.Key) || strings.Contains(logs, req.Tenant) || strings.Contains(logs, "4242") {
		t.Fatalf("the log holds the raw key, tenant or reply:\n%s", logs)
	}
}

func TestSealedOutcomeReplays(t *testing.T) {
	for _, mode := range []string{"two-phase", "atomic"} {
		t.Run(mode, func(t *testing.T) {
			h := newHarness(t, WithSealer(newTestRing(t, 1)))
			op := h.op
			if mode == "atomic" {
				op = h.atomic
			}
			h.recorded(t, op, req, secretReply)
			stored, ok := h.st.outcome(reqKey)
			if !ok || bytes.Contains(stored, []byte("4242")) {
				t.Fatalf("the store holds %q, want it sealed", stored)
			}
			if _, sealed := seal.SealedWith(stored); !sealed {
				t.Fatalf("the store holds %x, which is not sealed", stored)
			}
			for _, r := range []request{req, {Tenant: req.Tenant, Key: req.Key, Fingerprint: req.Fingerprint, Retried: true}} {
				c := h.start(t.Context(), op, r)
				if c.Verdict != Replayed || string(c.Outcome) != secretReply {
					t.Fatalf("retry (Retried %v): %v %q, want the reply replayed", r.Retried, c.Verdict, c.Outcome)
				}
			}
		})
	}
}

// A record that does not open is never replayed and never runs again: it is
// answered as a failed store, even failing open, and logged at Error without
// the raw key or tenant.
func TestUnopenedRecordFailsClosed(t *testing.T) {
	for name, tc := range map[string]struct {
		write, read *seal.KeyRing // nil: no sealer
		tamper      bool
		want        string // in the log
	}{
		"unknown key":       {write: newTestRing(t, 1), read: newTestRing(t, 2), want: "key ring does not hold"},
		"tampered":          {write: newTestRing(t, 1), read: newTestRing(t, 1), tamper: true, want: "altered"},
		"not sealed":        {read: newTestRing(t, 1), want: "not sealed"},
		"sealed, no sealer": {write: newTestRing(t, 1), want: "sealed (key id " + newTestRing(t, 1).PrimaryKeyID() + "), and this engine has no sealer"},
	} {
		for _, failOpen := range []bool{false, true} {
			for _, retried := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/failopen=%v/retried=%v", name, failOpen, retried), func(t *testing.T) {
					h := newHarness(t, WithSealer(tc.write))
					h.recorded(t, h.op, req, secretReply)
					if tc.tamper {
						h.st.mu.Lock()
						h.st.records[reqKey].outcome[len(secretReply)/2] ^= 1
						h.st.mu.Unlock()
					}
					opts := []Option{WithSealer(tc.read), WithLogger(h.e.Logger())}
					if failOpen {
						opts = append(opts, WithFailOpen())
					}
					e := mustEngine(t, h.st, opts...)
					op, _ := e.Operation(OperationSpec{Name: opName})
					c := e.newCall(op)
					r := req
					r.Retried = retried
					c.start(t.Context(), r)
					if c.Verdict != StoreUnavailable {
						t.Fatalf("fail-open %v, retried %v: verdict %v, want store_unavailable", failOpen, retried, c.Verdict)
					}
					if logs := h.logs.String(); !strings.Contains(logs, "level=ERROR") || !strings.Contains(logs, "does not open") || !strings.Contains(logs, tc.want) {
						t.Fatalf("the log does not say why at Error (want %q):\n%s", tc.want, logs)
					}
					h.wantNoRaw(t)
				})
			}
		}
	}
}

// A record sealed with a previous key replays; a new one is sealed with the
// primary key.
func TestSealRotation(t *testing.T) {
	h := newHarness(t, WithSealer(newTestRing(t, 1)))
	h.recorded(t, h.op, req, secretReply)
	e := mustEngine(t, h.st, WithSealer(newTestRing(t, 2, 1)), WithLogger(h.e.Logger()))
	op, _ := e.Operation(OperationSpec{Name: opName})
	c := e.newCall(op)
	c.start(t.Context(), req)
	if c.Verdict != Replayed || string(c.Outcome) != secretReply {
		t.Fatalf("after rotation: %v %q, want the old record replayed", c.Verdict, c.Outcome)
	}
	r2 := request{Tenant: req.Tenant, Key: "key-2", Fingerprint: req.Fingerprint}
	c = e.newCall(op)
	c.start(t.Context(), r2)
	if c.Verdict != Executed {
		t.Fatalf("a new key: %v", c.Verdict)
	}
	if err := c.record(t.Context(), []byte("new"), true); err != nil {
		t.Fatal(err)
	}
	stored, _ := h.st.outcome(store.ScopeKey(r2.Tenant, opName, r2.Key))
	if id, _ := seal.SealedWith(stored); id != newTestRing(t, 2).PrimaryKeyID() {
		t.Fatalf("the new record is sealed with key %q, want the primary", id)
	}
}

// A key reused with another request is refused as reused, whether or not
// its record would open: its outcome is never read.
func TestReusedKeyOfUnopenedRecord(t *testing.T) {
	h := newHarness(t, WithSealer(newTestRing(t, 1)))
	h.recorded(t, h.op, req, secretReply)
	e := mustEngine(t, h.st, WithSealer(newTestRing(t, 2)), WithLogger(h.e.Logger()))
	op, _ := e.Operation(OperationSpec{Name: opName})
	c := e.newCall(op)
	c.start(t.Context(), other)
	if c.Verdict != Reused {
		t.Fatalf("verdict %v, want reused", c.Verdict)
	}
}

// A store with bounds sets room aside for the sealed outcome, which is
// larger than the engine's bound on the outcome.
func TestSealedReservationRoom(t *testing.T) {
	h := newHarness(t, WithSealer(newTestRing(t, 1)), WithMaxRecordSize(4096))
	h.executed(t, h.op, req).release(t.Context())
	if got := h.st.lastReceived(t).MaxOutcome; got != 4096+seal.Overhead {
		t.Fatalf("MaxOutcome %d, want %d", got, 4096+seal.Overhead)
	}
	h.executed(t, h.atomic, other).release(t.Context())
	if got := h.st.lastReceived(t).MaxOutcome; got != 4096+seal.Overhead {
		t.Fatalf("atomic: MaxOutcome %d, want %d", got, 4096+seal.Overhead)
	}
}

// A nil *seal.KeyRing seals nothing, as no sealer does.
func TestNilKeyRing(t *testing.T) {
	var ring *seal.KeyRing
	h := newHarness(t, WithSealer(ring))
	h.recorded(t, h.op, req, "plain")
	if stored, _ := h.st.outcome(reqKey); string(stored) != "plain" {
		t.Fatalf("stored %q", stored)
	}
}

type failingSealer struct{ *seal.KeyRing }

var errSealer = errors.New("key service unreachable")

func (failingSealer) Seal(store.Key, []byte) ([]byte, error) { return nil, errSealer }

// A sealer that fails to seal in atomic mode commits nothing: the call's
// writes roll back with its reservation.
func TestSealFailureInAtomicMode(t *testing.T) {
	h := newHarness(t, WithSealer(failingSealer{newTestRing(t, 1)}))
	c := h.executed(t, h.atomic, req)
	if !write(c.contextFor(t.Context()), "charge") {
		t.Fatal("no transaction in the handler's context")
	}
	if err := c.record(t.Context(), []byte(secretReply), true); !errors.Is(err, errSealer) {
		t.Fatalf("Record: %v, want the sealer's error", err)
	}
	if h.st.has(reqKey) || len(h.st.committedWrites()) > 0 || h.st.count(mRollback) != 1 {
		t.Fatalf("after a failed seal: record %v, writes %v, rollbacks %d; want none, none, 1",
			h.st.has(reqKey), h.st.committedWrites(), h.st.count(mRollback))
	}
}
