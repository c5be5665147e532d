// Package sealtest checks sealing (engine.WithSealer, package seal) on a
// real store, through the engine, as storetest checks a store's contract:
// what the store holds is sealed, with no plaintext of the reply; a record
// replays across a key rotation; one copied onto another key's record, or
// altered, or sealed with a key the ring lacks, or not sealed, fails closed
// and runs nothing again. Each store's tests call Run, with a Raw function
// that reads the bytes the store itself holds (SQL, HGET), so that nothing
// of the engine vouches for them, and a Write function that overwrites them
// there (UPDATE, HSET).
package sealtest

import (
	"bytes"
	"context"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/enginetest"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
)

// Store is one store under test.
type Store struct {
	// New returns an empty store for one case.
	New func(t *testing.T) Instance
	// Atomic also runs every case in atomic mode: the store implements
	// store.Atomic.
	Atomic bool
}

// Instance is one store, empty at first.
type Instance struct {
	Store store.Store
	// Raw returns the outcome the store holds for key, read from its own
	// storage, not through store.Store.
	Raw func(t *testing.T, key store.Key) []byte
	// Write, if not nil, overwrites the outcome of key's completed record in
	// the store's own storage (SQL UPDATE, HSET), as someone with write
	// access to it could. Without it, such a record is made through
	// store.Store.
	Write func(t *testing.T, key store.Key, outcome []byte)
}

// secret is in the reply, and must be nowhere in the store or the logs.
const secret = "card 4242 4242 4242 4242, 1 Main St"

const (
	operation = "/example.payments.v1.PaymentService/CreateCharge"
	tenant    = "tenant-sealtest"
)

// Keys (and tenants) never to be logged.
var userKeys = []string{"order-sealtest-1", "order-sealtest-2", "order-sealtest-3", "order-sealtest-4"}

// Ring returns a key ring whose primary key is made of the byte primary and
// whose previous keys of the bytes previous.
func Ring(t testing.TB, primary byte, previous ...byte) *seal.KeyRing {
	t.Helper()
	var keys [][]byte
	for _, p := range previous {
		keys = append(keys, bytes.Repeat([]byte{p}, seal.KeySize))
	}
	r, err := seal.NewKeyRing(bytes.Repeat([]byte{primary}, seal.KeySize), seal.WithPreviousKeys(keys...))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Run runs every case on s, in two-phase mode and, if s.Atomic, in atomic
// mode.
func Run(t *testing.T, s Store) {
	modes := []bool{false}
	if s.Atomic {
		modes = append(modes, true)
	}
	for _, atomic := range modes {
		name := "two-phase"
		if atomic {
			name = "atomic"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			in := s.New(t)
			h := &harness{t: t, st: in.Store, raw: in.Raw, write: in.Write, atomic: atomic}
			h.logger, h.logs = logtest.New()
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("log:\n%s", h.logs)
				}
			})
			h.run()
		})
	}
}

type harness struct {
	t      *testing.T
	st     store.Store
	raw    func(t *testing.T, key store.Key) []byte
	write  func(t *testing.T, key store.Key, outcome []byte)
	atomic bool
	logger *slog.Logger
	logs   *logtest.Buffer
	runs   int
	decoys int // runs of put
}

func (h *harness) engine(ring engine.Sealer, opts ...engine.Option) (*engine.Engine, *engine.Operation) {
	h.t.Helper()
	e, err := engine.New(h.st, append([]engine.Option{engine.WithTenant(func(context.Context) (string, error) { return tenant, nil }), engine.WithSealer(ring), engine.WithLogger(h.logger)}, opts...)...)
	if err != nil {
		h.t.Fatal(err)
	}
	op, err := e.Operation(engine.OperationSpec{Name: operation, Atomic: h.atomic})
	if err != nil {
		h.t.Fatal(err)
	}
	return e, op
}

// call makes one call of key with the request "charge", on e: if it holds
// the key it runs the handler, which replies reply; it returns the verdict
// and what the call answered.
func (h *harness) call(e *engine.Engine, op *engine.Operation, key, reply string) (engine.Verdict, string) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(h.t.Context(), 30*time.Second)
	defer cancel()
	c := enginetest.Serve(ctx, e, op, key, []byte(reply))
	if c.Ran {
		h.runs++
	}
	return c.Answered.Verdict, string(c.Got())
}

func scope(key string) store.Key { return store.ScopeKey(tenant, operation, key) }

func (h *harness) run() {
	t := h.t
	old, oldOp := h.engine(Ring(t, 1))

	// Sealed at rest, and replayed.
	if v, got := h.call(old, oldOp, userKeys[0], secret); v != engine.Executed || got != secret {
		t.Fatalf("first call: %v %q", v, got)
	}
	raw := h.raw(t, scope(userKeys[0]))
	if bytes.Contains(raw, []byte("4242")) || bytes.Contains(raw, []byte("Main St")) {
		t.Fatalf("the store holds the reply in the clear: %q", raw)
	}
	if id, sealed := seal.SealedWith(raw); !sealed || id != Ring(t, 1).PrimaryKeyID() {
		t.Fatalf("the store holds %x: not sealed with the primary key", raw)
	}
	h.wantReplay(old, oldOp, userKeys[0], secret)

	// Rotated: the old record replays, a new one is sealed with the new key.
	rotated, rotatedOp := h.engine(Ring(t, 2, 1))
	h.wantReplay(rotated, rotatedOp, userKeys[0], secret)
	if v, _ := h.call(rotated, rotatedOp, userKeys[1], "after rotation"); v != engine.Executed {
		t.Fatalf("a new key after rotation: %v", v)
	}
	if id, _ := seal.SealedWith(h.raw(t, scope(userKeys[1]))); id != Ring(t, 2).PrimaryKeyID() {
		t.Fatalf("a record made after rotation is sealed with key %q, want the new primary", id)
	}
	// A replica with the old key alone cannot open it.
	h.wantClosed(old, oldOp, userKeys[1], "key ring does not hold")

	// A ciphertext copied onto another key's record does not open there.
	h.put(rotated, rotatedOp, userKeys[2], raw)
	h.wantClosed(rotated, rotatedOp, userKeys[2], "copied from another key")

	// Nor does an altered one.
	altered := bytes.Clone(raw)
	altered[len(altered)/2] ^= 0x10
	h.put(rotated, rotatedOp, userKeys[3], altered)
	h.wantClosed(rotated, rotatedOp, userKeys[3], "altered")

	// An engine without a sealer refuses the sealed records.
	plain, plainOp := h.engine(nil)
	h.wantClosed(plain, plainOp, userKeys[0], "no sealer")

	// A record written before sealing was turned on is refused, unless the
	// ring accepts unsealed records.
	unsealed := "order-sealtest-unsealed"
	if v, _ := h.call(plain, plainOp, unsealed, "before sealing"); v != engine.Executed {
		t.Fatalf("a call without sealing: %v", v)
	}
	h.wantClosed(rotated, rotatedOp, unsealed, "not sealed")
	accepting, acceptingOp := h.engine(must(seal.NewKeyRing(bytes.Repeat([]byte{2}, seal.KeySize), seal.WithUnsealedAccepted())))
	h.wantReplay(accepting, acceptingOp, unsealed, "before sealing")

	if want := 3 + h.decoys; h.runs != want {
		t.Fatalf("the handler ran %d times, want %d", h.runs, want)
	}
	// A call's duration and scope hash are the log's own numbers, which
	// can hold "4242" by chance: they are left out of the search.
	logs := ownNumbers.ReplaceAllString(h.logs.String(), "")
	for _, raw := range append(userKeys, tenant, "4242") {
		if strings.Contains(logs, raw) {
			t.Fatalf("the log holds %q:\n%s", raw, logs)
		}
	}
}

func must(r *seal.KeyRing, err error) *seal.KeyRing {
	if err != nil {
		panic(err)
	}
	return r
}

func (h *harness) wantReplay(e *engine.Engine, op *engine.Operation, key, want string) {
	h.t.Helper()
	if v, got := h.call(e, op, key, "a second run"); v != engine.Replayed || got != want {
		h.t.Fatalf("retry of %s: %v %q, want %q replayed", key, v, got, want)
	}
}

// wantClosed checks that a call of key fails closed, with an Error log that
// says why (reason).
func (h *harness) wantClosed(e *engine.Engine, op *engine.Operation, key, reason string) {
	h.t.Helper()
	before := len(h.logs.String())
	if v, _ := h.call(e, op, key, "a second run"); v != engine.StoreUnavailable {
		h.t.Fatalf("call of %s: verdict %v, want store_unavailable", key, v)
	}
	logged := h.logs.String()[before:]
	if !strings.Contains(logged, "level=ERROR") || !strings.Contains(logged, "does not open") || !strings.Contains(logged, reason) {
		h.t.Fatalf("call of %s: want an Error saying %q, logged:\n%s", key, reason, logged)
	}
}

// put makes key's record a completed one holding outcome as it is, as
// someone with write access to the store's storage could: a call of key
// records a reply of its own, then Write overwrites it; without Write, the
// record is made through the store's API.
func (h *harness) put(e *engine.Engine, op *engine.Operation, userKey string, outcome []byte) {
	h.t.Helper()
	key := scope(userKey)
	if h.write != nil {
		if v, _ := h.call(e, op, userKey, "a reply of its own"); v != engine.Executed {
			h.t.Fatalf("call of %s: %v", userKey, v)
		}
		h.decoys++
		h.write(h.t, key, outcome)
		return
	}
	ctx := h.t.Context()
	res, err := h.st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour, MaxOutcome: 4096})
	if err != nil || res.State != store.Acquired {
		h.t.Fatalf("reserve: %v %v", res.State, err)
	}
	if err := h.st.Complete(ctx, key, res.Token, outcome); err != nil {
		h.t.Fatal(err)
	}
}

// ownNumbers are the fields of a log line whose values idemkey makes: the
// call's duration and the scope's hash.
var ownNumbers = regexp.MustCompile(`(took|scope)=\S+`)
