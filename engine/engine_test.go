package engine

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store"
)

// TestMain fails the package if a test leaves a goroutine behind, such as a
// background Complete still retrying.
func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

// The fake store.

// The methods of fakeStore and fakeTx, as fail and calls name them.
const (
	mReserve  = "Reserve"
	mComplete = "Complete"
	mRelease  = "Release"
	mFind     = "Find"
	mBegin    = "Begin"
	mCommit   = "Commit"
	mRollback = "Rollback"
)

// forever makes fail fail every call.
const forever = -1

// errDown is a transient store failure, as from a lost connection.
var errDown = fmt.Errorf("fake store: connection reset: %w", store.ErrUnavailable)

// fakeStore is an in-memory store.Store, store.Finder and store.Atomic: a map
// under a mutex. Every method counts its calls and can be told to fail with a
// given error (fail). It is simpler than store/memory: records never expire,
// and it ignores ctx, so that a test's deadline decides what the engine does,
// never what the store does.
type fakeStore struct {
	mu        sync.Mutex
	records   map[store.Key]*fakeRecord
	lastToken store.Token
	calls     map[string]int
	fails     map[string]failure
	received  []store.Reservation // by Reserve and Begin, in order
	writes    []string            // the handler writes committed in atomic mode
	steps     map[fakeStepID]*store.StepEntry
}

type fakeStepID struct {
	key  store.Key
	name string
}

type failure struct {
	err   error
	times int // calls still to fail; forever for all of them
}

type fakeRecord struct {
	fingerprint store.Fingerprint
	token       store.Token
	completed   bool
	outcome     []byte
	leaseEnd    time.Time
	tx          *fakeTx // the open transaction that holds the record, if any
}

var (
	_ store.Store   = (*fakeStore)(nil)
	_ store.Finder  = (*fakeStore)(nil)
	_ store.Atomic  = (*fakeStore)(nil)
	_ store.Stepper = (*fakeStore)(nil)
)

func newFakeStore() *fakeStore {
	return &fakeStore{records: map[store.Key]*fakeRecord{}, calls: map[string]int{}, fails: map[string]failure{},
		steps: map[fakeStepID]*store.StepEntry{}}
}

// fail makes the next times calls of method return err (every call if times
// is forever); a nil err stops the failures.
func (s *fakeStore) fail(method string, err error, times int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		delete(s.fails, method)
		return
	}
	s.fails[method] = failure{err, times}
}

// enterLocked counts a call of method and returns the error it fails with,
// if any.
func (s *fakeStore) enterLocked(method string) error {
	s.calls[method]++
	f, ok := s.fails[method]
	if !ok {
		return nil
	}
	if f.times != forever {
		if f.times--; f.times <= 0 {
			delete(s.fails, method)
		} else {
			s.fails[method] = f
		}
	}
	return f.err
}

// decideLocked is Reserve's decision on r (see store.Store). A record held by
// an open transaction is in progress with r's own fingerprint, as Begin
// answers when its bound passes.
func (s *fakeStore) decideLocked(r store.Reservation) (store.Entry, *fakeRecord) {
	now := time.Now()
	rec, ok := s.records[r.Key]
	switch {
	case !ok:
		rec = &fakeRecord{fingerprint: r.Fingerprint}
		s.records[r.Key] = rec
	case rec.completed:
		return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome}, nil
	case rec.tx != nil:
		return store.Entry{State: store.Held, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}, nil
	case now.Before(rec.leaseEnd) || rec.fingerprint != r.Fingerprint:
		return store.Entry{State: store.Held, Fingerprint: rec.fingerprint, RetryAfter: max(rec.leaseEnd.Sub(now), 0)}, nil
	}
	s.lastToken++
	rec.token, rec.leaseEnd = s.lastToken, now.Add(r.Lease)
	return store.Entry{State: store.Acquired, Token: rec.token}, rec
}

func (s *fakeStore) Reserve(_ context.Context, r store.Reservation) (store.Entry, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.received = append(s.received, r)
	if err := s.enterLocked(mReserve); err != nil {
		return store.Entry{}, err
	}
	res, _ := s.decideLocked(r)
	return res, nil
}

// heldLocked returns the in-progress record of key that token holds.
func (s *fakeStore) heldLocked(key store.Key, token store.Token) (*fakeRecord, error) {
	rec, ok := s.records[key]
	if !ok || rec.token != token || rec.completed || rec.tx != nil {
		return nil, fmt.Errorf("fake store: token %d: %w", token, store.ErrLeaseLost)
	}
	return rec, nil
}

func (s *fakeStore) Complete(_ context.Context, key store.Key, token store.Token, outcome []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enterLocked(mComplete); err != nil {
		return err
	}
	rec, err := s.heldLocked(key, token)
	if err != nil {
		return err
	}
	rec.completed, rec.outcome = true, outcome
	return nil
}

func (s *fakeStore) Release(_ context.Context, key store.Key, token store.Token) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enterLocked(mRelease); err != nil {
		return err
	}
	if _, err := s.heldLocked(key, token); err != nil {
		return err
	}
	delete(s.records, key)
	return nil
}

func (s *fakeStore) Find(_ context.Context, key store.Key) (store.Entry, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enterLocked(mFind); err != nil {
		return store.Entry{}, false, err
	}
	rec, ok := s.records[key]
	if !ok || !rec.completed {
		return store.Entry{}, false, nil
	}
	return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome}, true, nil
}

// stepHolderLocked fences a step's write: a token must hold key in progress;
// token 0 is the open transaction's, which must hold it.
func (s *fakeStore) stepHolderLocked(key store.Key, token store.Token) error {
	if token != 0 {
		_, err := s.heldLocked(key, token)
		return err
	}
	if rec, ok := s.records[key]; !ok || rec.tx == nil {
		return fmt.Errorf("fake store: no transaction holds the key: %w", store.ErrLeaseLost)
	}
	return nil
}

func (s *fakeStore) StartStep(_ context.Context, r store.StepStart) (store.StepEntry, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stepHolderLocked(r.Key, r.Token); err != nil {
		return store.StepEntry{}, err
	}
	id := fakeStepID{r.Key, r.Name}
	if st, ok := s.steps[id]; ok {
		return *st, nil
	}
	s.steps[id] = &store.StepEntry{State: store.StepStarted, Fingerprint: r.Fingerprint}
	return store.StepEntry{State: store.StepNew}, nil
}

func (s *fakeStore) FinishStep(_ context.Context, key store.Key, token store.Token, name string, result []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stepHolderLocked(key, token); err != nil {
		return err
	}
	st, ok := s.steps[fakeStepID{key, name}]
	if !ok {
		return fmt.Errorf("fake store: no such step: %w", store.ErrLeaseLost)
	}
	st.State, st.Result = store.StepDone, result
	return nil
}

func (s *fakeStore) ForgetSteps(_ context.Context, key store.Key, token store.Token, names ...string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stepHolderLocked(key, token); err != nil {
		return err
	}
	for id := range s.steps {
		if id.key == key && (len(names) == 0 || slices.Contains(names, id.name)) {
			delete(s.steps, id)
		}
	}
	return nil
}

// Begin reserves r in a transaction. The fake does not mix modes: a key is
// used either in two-phase mode or in atomic mode, never both.
func (s *fakeStore) Begin(_ context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.received = append(s.received, r)
	if err := s.enterLocked(mBegin); err != nil {
		return store.Entry{}, nil, err
	}
	res, rec := s.decideLocked(r)
	if res.State != store.Acquired {
		return res, nil, nil
	}
	tx := &fakeTx{s: s, key: r.Key, rec: rec}
	rec.tx = tx
	return res, tx, nil
}

// otherOutcome is the record of the other call that a Commit failing with
// store.ErrLeaseLost finds.
const otherOutcome = "the other call's outcome"

// fakeTx is a transaction of fakeStore, which holds its reservation and the
// handler's writes until it ends.
type fakeTx struct {
	s      *fakeStore
	key    store.Key
	rec    *fakeRecord
	writes []string // guarded by s.mu
	ended  bool     // guarded by s.mu
}

type txKey struct{}

func (tx *fakeTx) HandlerContext(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// write is a handler's write of row in the transaction of its context; false
// if the context carries none.
func write(ctx context.Context, row string) bool {
	tx, ok := ctx.Value(txKey{}).(*fakeTx)
	if !ok {
		return false
	}
	tx.s.mu.Lock()
	defer tx.s.mu.Unlock()
	tx.writes = append(tx.writes, row)
	return true
}

// Commit records outcome and commits; on a failure nothing is committed and
// the key is free again.
func (tx *fakeTx) Commit(_ context.Context, outcome []byte, keepWrites bool) error {
	s := tx.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if tx.ended {
		return errors.New("fake store: the transaction has ended")
	}
	tx.ended = true
	if err := s.enterLocked(mCommit); err != nil {
		if errors.Is(err, store.ErrLeaseLost) { // as if another call recorded the key first
			tx.rec.tx, tx.rec.completed, tx.rec.outcome = nil, true, []byte(otherOutcome)
			return err
		}
		delete(s.records, tx.key)
		return err
	}
	tx.rec.tx, tx.rec.completed, tx.rec.outcome = nil, true, outcome
	if keepWrites {
		s.writes = append(s.writes, tx.writes...)
	}
	return nil
}

func (tx *fakeTx) Rollback(context.Context) error {
	s := tx.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if tx.ended {
		return errors.New("fake store: the transaction has ended")
	}
	tx.ended = true
	delete(s.records, tx.key) // before the failure: a database rolls back when the connection closes
	return s.enterLocked(mRollback)
}

// count returns how many times method was called.
func (s *fakeStore) count(method string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[method]
}

// resetCounts sets every count back to zero.
func (s *fakeStore) resetCounts() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.calls)
}

// lastReceived returns the last reservation Reserve or Begin received.
func (s *fakeStore) lastReceived(t *testing.T) store.Reservation {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.received) == 0 {
		t.Fatal("the store received no reservation")
	}
	return s.received[len(s.received)-1]
}

// outcome returns the recorded outcome of key; false if key has none.
func (s *fakeStore) outcome(key store.Key) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.records[key]
	if !ok || !rec.completed {
		return nil, false
	}
	return rec.outcome, true
}

// has reports whether key has a record, in progress or completed.
func (s *fakeStore) has(key store.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.records[key]
	return ok
}

// committedWrites returns the handler writes committed in atomic mode.
func (s *fakeStore) committedWrites() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.writes)
}

// plainStore hides every method of a store but store.Store's: a store
// without store.Atomic or store.Finder.
type plainStore struct{ store.Store }

// The harness.

const opName = "/test.v1.Payments/Charge"

// harness is an engine on a fake store, with an operation in each mode and a
// log of every level.
type harness struct {
	st     *fakeStore
	e      *Engine
	op     *Operation // two-phase
	atomic *Operation // atomic mode
	logs   *logtest.Buffer
}

func newHarness(t *testing.T, opts ...Option) *harness {
	t.Helper()
	h := &harness{st: newFakeStore()}
	logger := newLogger(t, &h.logs)
	h.e = mustEngine(t, h.st, append([]Option{WithLogger(logger)}, opts...)...)
	var err error
	if h.op, err = h.e.Operation(OperationSpec{Name: opName}); err != nil {
		t.Fatalf("Operation: %v", err)
	}
	if h.atomic, err = h.e.Operation(OperationSpec{Name: opName, Atomic: true}); err != nil {
		t.Fatalf("Operation(Atomic): %v", err)
	}
	return h
}

// newLogger returns a logger of every level into *buf, whose records the
// test prints if it fails.
func newLogger(t *testing.T, buf **logtest.Buffer) *slog.Logger {
	logger, logs := logtest.New()
	*buf = logs
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log:\n%s", logs)
		}
	})
	return logger
}

// start starts a call of op with r.
func (h *harness) start(ctx context.Context, op *Operation, r request) *call {
	c := h.e.newCall(op)
	c.start(ctx, r)
	return &c
}

// executed starts a call of op with r and fails the test unless it holds the
// key.
func (h *harness) executed(t *testing.T, op *Operation, r request) *call {
	t.Helper()
	return executed(t, h.e, op, r)
}

// executed starts a call of op with r on e and fails the test unless it
// holds the key.
func executed(t *testing.T, e *Engine, op *Operation, r request) *call {
	t.Helper()
	c := e.newCall(op)
	if c.start(t.Context(), r); c.Verdict != Executed {
		t.Fatalf("first call: verdict %v, want executed", c.Verdict)
	}
	return &c
}

// started starts a call of op with r on e in a goroutine, and returns the
// channel that delivers the call once start returns.
func started(ctx context.Context, e *Engine, op *Operation, r request) <-chan *call {
	done := make(chan *call, 1)
	go func() {
		c := e.newCall(op)
		c.start(ctx, r)
		done <- &c
	}()
	return done
}

// recorded runs a call of op with r that records outcome.
func (h *harness) recorded(t *testing.T, op *Operation, r request, outcome string) {
	t.Helper()
	c := h.executed(t, op, r)
	if err := c.record(t.Context(), []byte(outcome), true); err != nil {
		t.Fatalf("Record: %v", err)
	}
}

func fingerprint(request string) store.Fingerprint { return sha256.Sum256([]byte(request)) }

// req is a request with a key; other is the same key with another request.
var (
	req   = request{Tenant: "tenant-a", Key: "key-1", Fingerprint: fingerprint("request-1")}
	other = request{Tenant: "tenant-a", Key: "key-1", Fingerprint: fingerprint("request-2")}
)

// eventually waits, generously, until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
	}
}

// receive waits, generously, for the call that ch delivers.
func receive(t *testing.T, ch <-chan *call) *call {
	t.Helper()
	select {
	case c := <-ch:
		return c
	case <-time.After(30 * time.Second):
		t.Fatal("the call did not return")
		return nil
	}
}

func wantCount(t *testing.T, st *fakeStore, method string, want int) {
	t.Helper()
	if got := st.count(method); got != want {
		t.Errorf("%s called %d times, want %d", method, got, want)
	}
}

// deadlineOnly is a context with a deadline that it does not enforce.
type deadlineOnly struct {
	context.Context
	deadline time.Time
}

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.deadline, true }

// The tests.

// TestStartVerdicts sets up a key in each state the store can hold it in, or
// a store failure, and checks the verdict start gives a call with it.
func TestStartVerdicts(t *testing.T) {
	fullErr := fmt.Errorf("fake store: reserve: %w", store.ErrFull)
	tests := []struct {
		name     string
		opts     []Option
		atomic   bool
		canceled bool                                    // the call's context is done
		before   func(t *testing.T, h *harness)          // the key's state, or a failure
		req      request                                 // req if zero
		want     Verdict                                 // start's verdict
		check    func(t *testing.T, h *harness, c *call) // more, with the counts since before
	}{{
		name: "a new key is executed",
		want: Executed,
		check: func(t *testing.T, h *harness, c *call) {
			wantCount(t, h.st, mReserve, 1)
			if c.inTx() {
				t.Error("a two-phase call reports Atomic")
			}
		},
	}, {
		name:   "a recorded key with the same fingerprint is replayed",
		before: func(t *testing.T, h *harness) { h.recorded(t, h.op, req, "outcome-1") },
		want:   Replayed,
		check: func(t *testing.T, h *harness, c *call) {
			if string(c.Outcome) != "outcome-1" {
				t.Errorf("Outcome = %q, want the recorded outcome-1", c.Outcome)
			}
		},
	}, {
		name:   "a key in progress with the same fingerprint is answered at once with WithInProgressWait(0)",
		opts:   []Option{WithInProgressWait(0), WithMaxRetryAfter(250 * time.Millisecond)},
		before: func(t *testing.T, h *harness) { h.executed(t, h.op, req) },
		want:   InProgress,
		check: func(t *testing.T, h *harness, c *call) {
			wantCount(t, h.st, mReserve, 1) // no poll
			if c.RetryAfter != 250*time.Millisecond {
				t.Errorf("RetryAfter = %v with a minute of lease left; want WithMaxRetryAfter's 250ms", c.RetryAfter)
			}
		},
	}, {
		name:   "RetryAfter of a key in progress is at most the lease left",
		opts:   []Option{WithInProgressWait(0), WithLease(3 * time.Second), WithMaxRetryAfter(time.Hour)},
		before: func(t *testing.T, h *harness) { h.executed(t, h.op, req) },
		want:   InProgress,
		check: func(t *testing.T, h *harness, c *call) {
			if c.RetryAfter < time.Millisecond || c.RetryAfter > 3*time.Second {
				t.Errorf("RetryAfter = %v, want within [1ms, 3s], the lease", c.RetryAfter)
			}
		},
	}, {
		name:   "RetryAfter of a key in progress is at least a millisecond",
		opts:   []Option{WithInProgressWait(0), WithMaxRetryAfter(time.Nanosecond)},
		before: func(t *testing.T, h *harness) { h.executed(t, h.op, req) },
		want:   InProgress,
		check: func(t *testing.T, h *harness, c *call) {
			if c.RetryAfter != time.Millisecond {
				t.Errorf("RetryAfter = %v with WithMaxRetryAfter(1ns), want 1ms", c.RetryAfter)
			}
		},
	}, {
		name:   "a recorded key with another fingerprint is reused",
		before: func(t *testing.T, h *harness) { h.recorded(t, h.op, req, "outcome-1") },
		req:    other,
		want:   Reused,
		check: func(t *testing.T, h *harness, c *call) {
			if c.Outcome != nil {
				t.Errorf("a reused key got Outcome %q", c.Outcome)
			}
		},
	}, {
		name:   "a key in progress with another fingerprint is reused, without waiting",
		opts:   []Option{WithInProgressWait(time.Second)},
		before: func(t *testing.T, h *harness) { h.executed(t, h.op, req) },
		req:    other,
		want:   Reused,
		check:  func(t *testing.T, h *harness, c *call) { wantCount(t, h.st, mReserve, 1) },
	}, {
		name:   "a failing store is unavailable",
		before: func(t *testing.T, h *harness) { h.st.fail(mReserve, errDown, forever) },
		want:   StoreUnavailable,
		check: func(t *testing.T, h *harness, c *call) {
			if !strings.Contains(h.logs.String(), "reserve failed") {
				t.Error("the failure was not logged")
			}
		},
	}, {
		name:     "a failing store with the call's context done is unavailable, not logged, even with WithFailOpen",
		opts:     []Option{WithFailOpen()},
		canceled: true,
		before:   func(t *testing.T, h *harness) { h.st.fail(mReserve, context.Canceled, forever) },
		want:     StoreUnavailable,
		check: func(t *testing.T, h *harness, c *call) {
			if strings.Contains(h.logs.String(), "failed") {
				t.Error("the failure of a call that was canceled was logged")
			}
		},
	}, {
		name:   "a full store refuses a new key, with RetryAfter",
		before: func(t *testing.T, h *harness) { h.st.fail(mReserve, fullErr, forever) },
		want:   StoreFull,
		check: func(t *testing.T, h *harness, c *call) {
			if c.RetryAfter != DefaultMaxRetryAfter {
				t.Errorf("RetryAfter = %v, want DefaultMaxRetryAfter", c.RetryAfter)
			}
		},
	}, {
		name:   "a full store refuses a new key even with WithFailOpen, with WithMaxRetryAfter's RetryAfter",
		opts:   []Option{WithFailOpen(), WithMaxRetryAfter(3 * time.Second)},
		before: func(t *testing.T, h *harness) { h.st.fail(mReserve, fullErr, forever) },
		want:   StoreFull,
		check: func(t *testing.T, h *harness, c *call) {
			if c.RetryAfter != 3*time.Second {
				t.Errorf("RetryAfter = %v, want WithMaxRetryAfter's 3s", c.RetryAfter)
			}
		},
	}, {
		name:   "RetryAfter of a full store is at least a millisecond",
		opts:   []Option{WithMaxRetryAfter(time.Nanosecond)},
		before: func(t *testing.T, h *harness) { h.st.fail(mReserve, fullErr, forever) },
		want:   StoreFull,
		check: func(t *testing.T, h *harness, c *call) {
			if c.RetryAfter != time.Millisecond {
				t.Errorf("RetryAfter = %v with WithMaxRetryAfter(1ns), want 1ms", c.RetryAfter)
			}
		},
	}, {
		name:   "a failing store with WithFailOpen fails open",
		opts:   []Option{WithFailOpen()},
		before: func(t *testing.T, h *harness) { h.st.fail(mReserve, errDown, forever) },
		want:   FailedOpen,
		check: func(t *testing.T, h *harness, c *call) {
			if !strings.Contains(h.logs.String(), "unprotected") {
				t.Error("failing open was not logged")
			}
			c.abandon(t.Context()) // neither recorded nor released
			wantCount(t, h.st, mRelease, 0)
		},
	}, {
		name:   "an atomic call holds the key in a transaction",
		atomic: true,
		want:   Executed,
		check: func(t *testing.T, h *harness, c *call) {
			wantCount(t, h.st, mBegin, 1)
			wantCount(t, h.st, mReserve, 0)
			if !c.inTx() {
				t.Error("an atomic call does not report Atomic")
			}
			c.release(t.Context())
		},
	}, {
		name:   "an atomic call fails closed even with WithFailOpen",
		opts:   []Option{WithFailOpen()},
		atomic: true,
		before: func(t *testing.T, h *harness) { h.st.fail(mBegin, errDown, forever) },
		want:   StoreUnavailable,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, tt.opts...)
			if tt.before != nil {
				tt.before(t, h)
			}
			h.st.resetCounts()
			op, r := h.op, tt.req
			if tt.atomic {
				op = h.atomic
			}
			if r == (request{}) {
				r = req
			}
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if tt.canceled {
				cancel()
			}
			c := h.start(ctx, op, r)
			if c.Verdict != tt.want {
				t.Fatalf("verdict %v, want %v", c.Verdict, tt.want)
			}
			if tt.check != nil {
				tt.check(t, h, c)
			}
		})
	}
}

// TestInProgressWait checks a duplicate that finds its key in progress: it
// waits for the first call, and never longer than its own deadline.
func TestInProgressWait(t *testing.T) {
	t.Run("replayed when the first call records meanwhile", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Minute))
		first := h.executed(t, h.op, req)
		done := started(t.Context(), h.e, h.op, req)
		eventually(t, "the duplicate's reservation", func() bool { return h.st.count(mReserve) >= 2 })
		if err := first.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v", err)
		}
		dup := receive(t, done)
		if dup.Verdict != Replayed || string(dup.Outcome) != "outcome-1" {
			t.Fatalf("duplicate: verdict %v, Outcome %q; want replayed outcome-1", dup.Verdict, dup.Outcome)
		}
		if n := h.st.count(mReserve); n < 3 {
			t.Errorf("Reserve called %d times, want the first call's, the duplicate's and at least one poll", n)
		}
	})

	t.Run("executed when the first call releases meanwhile", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Minute))
		first := h.executed(t, h.op, req)
		done := started(t.Context(), h.e, h.op, req)
		eventually(t, "the duplicate's reservation", func() bool { return h.st.count(mReserve) >= 2 })
		first.release(t.Context())
		dup := receive(t, done)
		if dup.Verdict != Executed {
			t.Fatalf("duplicate: verdict %v, want executed", dup.Verdict)
		}
		if err := dup.record(t.Context(), []byte("outcome-2"), true); err != nil {
			t.Fatalf("the duplicate's Record: %v", err)
		}
		if got, _ := h.st.outcome(h.st.lastReceived(t).Key); string(got) != "outcome-2" {
			t.Errorf("recorded %q, want the duplicate's outcome-2", got)
		}
	})

	t.Run("no longer than its own deadline", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Hour))
		h.executed(t, h.op, req)
		h.st.resetCounts()
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		began := time.Now()
		dup := h.start(ctx, h.op, req)
		if dup.Verdict != InProgress {
			t.Fatalf("duplicate: verdict %v, want in progress", dup.Verdict)
		}
		if took := time.Since(began); took > 30*time.Second {
			t.Errorf("the duplicate took %v, with a deadline of 300ms", took)
		}
		// A wait of w polls at most 5 + w/500ms times.
		if n := h.st.count(mReserve); n < 1 || n > 6 {
			t.Errorf("Reserve called %d times in a wait of less than 300ms, want 1 to 6", n)
		}
	})

	t.Run("not at all with a deadline too short to wait", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Hour))
		h.executed(t, h.op, req)
		h.st.resetCounts()
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
		defer cancel()
		dup := h.start(ctx, h.op, req)
		if dup.Verdict != InProgress {
			t.Fatalf("duplicate: verdict %v, want in progress", dup.Verdict)
		}
		wantCount(t, h.st, mReserve, 1)
	})

	t.Run("bounded by the deadline itself, not only by its cancellation", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Hour))
		h.executed(t, h.op, req)
		h.st.resetCounts()
		// A deadline 20ms away, whose Done never fires: only the engine's
		// reading of the deadline (less a margin for the answer) ends the wait.
		ctx := deadlineOnly{t.Context(), time.Now().Add(20 * time.Millisecond)}
		dup := receive(t, started(ctx, h.e, h.op, req))
		if dup.Verdict != InProgress {
			t.Fatalf("duplicate: verdict %v, want in progress", dup.Verdict)
		}
		wantCount(t, h.st, mReserve, 1)
	})

	t.Run("atomic: polled with Begin, replayed when the first call commits", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Minute))
		first := h.executed(t, h.atomic, req)
		done := started(t.Context(), h.e, h.atomic, req)
		eventually(t, "the duplicate's second Begin", func() bool { return h.st.count(mBegin) >= 3 })
		if err := first.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v", err)
		}
		dup := receive(t, done)
		if dup.Verdict != Replayed || string(dup.Outcome) != "outcome-1" {
			t.Fatalf("duplicate: verdict %v, Outcome %q; want replayed outcome-1", dup.Verdict, dup.Outcome)
		}
	})

	t.Run("atomic: acquired within the wait when the first call rolls back", func(t *testing.T) {
		h := newHarness(t, WithInProgressWait(time.Minute))
		first := h.executed(t, h.atomic, req)
		done := started(t.Context(), h.e, h.atomic, req)
		eventually(t, "the duplicate's second Begin", func() bool { return h.st.count(mBegin) >= 3 })
		first.release(t.Context())
		dup := receive(t, done)
		if dup.Verdict != Executed || !dup.inTx() {
			t.Fatalf("duplicate: verdict %v (atomic %v), want executed in a transaction", dup.Verdict, dup.inTx())
		}
		dup.abandon(t.Context())
	})
}

// TestStartAgain: a call answered InProgress may be started again, and holds the
// key once the first call released it, in either mode.
func TestStartAgain(t *testing.T) {
	h := newHarness(t, WithInProgressWait(0))
	for _, op := range []*Operation{h.op, h.atomic} {
		r := req
		r.Key = op.Name() + fmt.Sprint(op == h.atomic)
		first := h.executed(t, op, r)
		again := h.start(t.Context(), op, r)
		if again.Verdict != InProgress {
			t.Fatalf("atomic %v: verdict %v while the first call holds the key, want in progress", op == h.atomic, again.Verdict)
		}
		first.release(t.Context())
		again.start(t.Context(), r)
		if again.Verdict != Executed {
			t.Fatalf("atomic %v: verdict %v once the first call released the key, want executed", op == h.atomic, again.Verdict)
		}
		if err := again.record(t.Context(), []byte("outcome-2"), true); err != nil {
			t.Fatalf("atomic %v: Record: %v", op == h.atomic, err)
		}
		if replay := h.start(t.Context(), op, r); replay.Verdict != Replayed || string(replay.Outcome) != "outcome-2" {
			t.Fatalf("atomic %v: then verdict %v, Outcome %q; want replayed outcome-2", op == h.atomic, replay.Verdict, replay.Outcome)
		}
	}
}

// TestRecord checks what record writes, and what it answers when the store
// cannot take the outcome.
func TestRecord(t *testing.T) {
	t.Run("the outcome replays", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v", err)
		}
		wantCount(t, h.st, mComplete, 1)
		c.release(t.Context()) // a recorded key stays recorded
		wantCount(t, h.st, mRelease, 0)
		again := h.start(t.Context(), h.op, req)
		if again.Verdict != Replayed || string(again.Outcome) != "outcome-1" {
			t.Fatalf("later call: verdict %v, Outcome %q; want replayed outcome-1", again.Verdict, again.Outcome)
		}
	})

	t.Run("an outcome larger than WithMaxRecordSize is refused, and nothing written", func(t *testing.T) {
		h := newHarness(t, WithMaxRecordSize(2048))
		c := h.executed(t, h.op, req)
		key := h.st.lastReceived(t).Key
		if err := c.record(t.Context(), bytes.Repeat([]byte("x"), 2049), true); !errors.Is(err, ErrTooLarge) {
			t.Fatalf("Record of 2049 bytes: %v, want ErrTooLarge", err)
		}
		wantCount(t, h.st, mComplete, 0)
		if _, ok := h.st.outcome(key); ok {
			t.Fatal("an outcome too large was recorded")
		}
		if err := c.record(t.Context(), []byte("short error"), false); err != nil {
			t.Fatalf("Record of the short error in its place: %v", err)
		}
		if got, _ := h.st.outcome(key); string(got) != "short error" {
			t.Errorf("recorded %q, want the short error", got)
		}

		// The bound itself fits.
		c = h.executed(t, h.op, request{Key: "key-2", Fingerprint: fingerprint("request-1")})
		if err := c.record(t.Context(), bytes.Repeat([]byte("x"), 2048), true); err != nil {
			t.Errorf("Record of 2048 bytes, the bound: %v", err)
		}
	})

	t.Run("a full store is returned", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		h.st.fail(mComplete, fmt.Errorf("fake store: complete: %w", store.ErrFull), 1)
		if err := c.record(t.Context(), []byte("a large reply"), true); !errors.Is(err, store.ErrFull) {
			t.Fatalf("Record: %v, want store.ErrFull", err)
		}
		if err := c.record(t.Context(), []byte("short error"), false); err != nil {
			t.Fatalf("Record of the short error in its place: %v", err)
		}
		if got, _ := h.st.outcome(h.st.lastReceived(t).Key); string(got) != "short error" {
			t.Errorf("recorded %q, want the short error", got)
		}
	})

	t.Run("a transient failure is retried in the background", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		key := h.st.lastReceived(t).Key
		h.st.fail(mComplete, errDown, 1)
		if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v, want nil: the handler has run", err)
		}
		eventually(t, "the record, written in the background", func() bool {
			_, ok := h.st.outcome(key)
			return ok && strings.Contains(h.logs.String(), "complete succeeded in the background")
		})
		if got, _ := h.st.outcome(key); string(got) != "outcome-1" {
			t.Errorf("recorded %q, want outcome-1", got)
		}
		wantCount(t, h.st, mComplete, 2)
	})

	t.Run("a lost lease is logged, not returned", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		h.st.fail(mComplete, fmt.Errorf("fake store: %w", store.ErrLeaseLost), 1)
		if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v, want nil", err)
		}
		if logs := h.logs.String(); !strings.Contains(logs, "level=WARN") || !strings.Contains(logs, "lease was taken over") {
			t.Error("the lost lease was not logged as a warning")
		}
		wantCount(t, h.st, mComplete, 1)
	})

	t.Run("a store that lost its data is logged at Error, not retried", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		h.st.fail(mComplete, fmt.Errorf("fake store: %w: flushed", store.ErrDataLost), 1)
		if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v, want nil: the handler has run", err)
		}
		if logs := h.logs.String(); !strings.Contains(logs, "level=ERROR") || !strings.Contains(logs, "the store lost its data") || strings.Contains(logs, "background") {
			t.Errorf("the lost data was not logged at Error, or a retry in the background was; logged:\n%s", logs)
		}
		time.Sleep(3 * 100 * time.Millisecond) // past a first retry in the background
		wantCount(t, h.st, mComplete, 1)
	})
}

// TestReleaseAndAbandon checks that release frees the key for the next call,
// and that abandon releases only a call that holds the key and has not ended.
func TestReleaseAndAbandon(t *testing.T) {
	t.Run("Release frees the key", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		key := h.st.lastReceived(t).Key
		c.release(t.Context())
		wantCount(t, h.st, mRelease, 1)
		if h.st.has(key) {
			t.Fatal("the key still has a record")
		}
		h.executed(t, h.op, req)
		c.release(t.Context()) // once only
		wantCount(t, h.st, mRelease, 1)
	})

	t.Run("a failing Release is logged", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		h.st.fail(mRelease, errDown, 1)
		c.release(t.Context())
		if !strings.Contains(h.logs.String(), "release failed") {
			t.Error("the failure was not logged")
		}
	})

	tests := []struct {
		name        string
		run         func(t *testing.T, h *harness) *call // the call to abandon
		wantRelease int
	}{{
		name: "after a panic",
		run: func(t *testing.T, h *harness) *call {
			c := h.executed(t, h.op, req)
			func() {
				defer func() { _ = recover() }()
				defer c.abandon(t.Context())
				panic("the handler panics")
			}()
			return c
		},
		wantRelease: 1,
	}, {
		name: "after Record",
		run: func(t *testing.T, h *harness) *call {
			c := h.executed(t, h.op, req)
			if err := c.record(t.Context(), []byte("outcome-1"), true); err != nil {
				t.Fatalf("Record: %v", err)
			}
			return c
		},
	}, {
		name: "after a Record refused as too large",
		run: func(t *testing.T, h *harness) *call {
			c := h.executed(t, h.op, req)
			if err := c.record(t.Context(), bytes.Repeat([]byte("x"), DefaultMaxRecordSize+1), true); !errors.Is(err, ErrTooLarge) {
				t.Fatalf("Record: %v, want ErrTooLarge", err)
			}
			return c
		},
	}, {
		name: "after Release",
		run: func(t *testing.T, h *harness) *call {
			c := h.executed(t, h.op, req)
			c.release(t.Context())
			return c
		},
		wantRelease: 1, // release's own
	}, {
		name: "of a replayed call",
		run: func(t *testing.T, h *harness) *call {
			h.recorded(t, h.op, req, "outcome-1")
			return h.start(t.Context(), h.op, req)
		},
	}, {
		name: "of a call in progress",
		run: func(t *testing.T, h *harness) *call {
			h.executed(t, h.op, req)
			return h.start(t.Context(), h.op, req)
		},
	}}
	for _, tt := range tests {
		t.Run("Abandon "+tt.name, func(t *testing.T) {
			h := newHarness(t, WithInProgressWait(0))
			c := tt.run(t, h)
			c.abandon(t.Context())
			wantCount(t, h.st, mRelease, tt.wantRelease)
			if tt.wantRelease == 1 {
				h.executed(t, h.op, req) // the key is free
			}
		})
	}
}

// TestAtomic checks atomic mode: the handler writes in the store's
// transaction, which commits with the record or rolls back.
func TestAtomic(t *testing.T) {
	type ctxKey struct{}
	callerCtx := func(t *testing.T) context.Context { return context.WithValue(t.Context(), ctxKey{}, "caller's") }

	t.Run("needs a store that implements store.Atomic", func(t *testing.T) {
		e := mustEngine(t, plainStore{newFakeStore()}, WithLogger(nil))
		if op, err := e.Operation(OperationSpec{Name: opName, Atomic: true}); err == nil || op != nil {
			t.Fatalf("Operation(Atomic) on a store without store.Atomic: %v, %v; want an error", op, err)
		}
		if _, err := e.Operation(OperationSpec{Name: opName}); err != nil {
			t.Fatalf("two-phase Operation: %v", err)
		}
	})

	t.Run("a two-phase handler gets no transaction", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.op, req)
		hctx := c.contextFor(callerCtx(t))
		if write(hctx, "row") {
			t.Error("a two-phase handler's context carries a transaction")
		}
		if hctx.Value(ctxKey{}) != "caller's" {
			t.Error("the handler's context lost the caller's values")
		}
		c.release(t.Context())
	})

	tests := []struct {
		name       string
		keepWrites bool
		failCommit bool
		wantErr    error    // record's
		wantWrites []string // committed
		wantRecord bool
	}{
		{name: "Record commits the writes and the record", keepWrites: true, wantWrites: []string{"charge-1"}, wantRecord: true},
		{name: "Record without keepWrites commits the record only", keepWrites: false, wantRecord: true},
		{name: "a failing commit is returned, and nothing committed", keepWrites: true, failCommit: true, wantErr: errDown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			c := h.executed(t, h.atomic, req)
			key := h.st.lastReceived(t).Key
			hctx := c.contextFor(callerCtx(t))
			if !write(hctx, "charge-1") {
				t.Fatal("the handler's context carries no transaction")
			}
			if hctx.Value(ctxKey{}) != "caller's" {
				t.Error("the handler's context lost the caller's values")
			}
			if tt.failCommit {
				h.st.fail(mCommit, errDown, 1)
			}
			if err := c.record(t.Context(), []byte("outcome-1"), tt.keepWrites); !errors.Is(err, tt.wantErr) {
				t.Fatalf("Record: %v, want %v", err, tt.wantErr)
			}
			wantCount(t, h.st, mCommit, 1)
			wantCount(t, h.st, mComplete, 0)
			c.abandon(t.Context()) // ended: nothing to roll back
			wantCount(t, h.st, mRollback, 0)
			if got := h.st.committedWrites(); !slices.Equal(got, tt.wantWrites) {
				t.Errorf("committed writes %q, want %q", got, tt.wantWrites)
			}
			got, ok := h.st.outcome(key)
			if ok != tt.wantRecord || (ok && string(got) != "outcome-1") {
				t.Errorf("record %q (%v), want outcome-1 (%v)", got, ok, tt.wantRecord)
			}
			want := Executed // the key is free
			if tt.wantRecord {
				want = Replayed
			}
			next := h.start(t.Context(), h.atomic, req)
			if next.Verdict != want {
				t.Errorf("next call: verdict %v, want %v", next.Verdict, want)
			}
			next.abandon(t.Context())
		})
	}

	t.Run("a commit that lost the key answers as the other call's record says", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.atomic, req)
		write(c.contextFor(t.Context()), "charge-1")
		h.st.fail(mCommit, fmt.Errorf("fake store: %w", store.ErrLeaseLost), 1)
		if err := c.record(t.Context(), []byte("outcome-1"), true); !errors.Is(err, errSuperseded) {
			t.Fatalf("Record: %v, want errSuperseded", err)
		}
		if c.Verdict != Replayed || string(c.Outcome) != otherOutcome {
			t.Errorf("verdict %v, Outcome %q; want replayed %q", c.Verdict, c.Outcome, otherOutcome)
		}
		if got := h.st.committedWrites(); len(got) != 0 {
			t.Errorf("committed writes %q, want none", got)
		}
	})

	t.Run("Release rolls back the writes and the reservation", func(t *testing.T) {
		h := newHarness(t)
		c := h.executed(t, h.atomic, req)
		key := h.st.lastReceived(t).Key
		write(c.contextFor(t.Context()), "charge-1")
		c.release(t.Context())
		wantCount(t, h.st, mRollback, 1)
		wantCount(t, h.st, mRelease, 0)
		if h.st.has(key) || len(h.st.committedWrites()) != 0 {
			t.Fatal("a rolled back call left a record or writes")
		}
		h.executed(t, h.atomic, req).abandon(t.Context()) // the key is free
		wantCount(t, h.st, mRollback, 2)
	})
}

// TestRetriedReadsFirst checks that a retried call on a store.Finder reads its
// record before it reserves.
func TestRetriedReadsFirst(t *testing.T) {
	retried := req
	retried.Retried = true
	otherRetried := other
	otherRetried.Retried = true
	tests := []struct {
		name    string
		opts    []Option
		plain   bool // a store without store.Finder
		atomic  bool
		record  bool  // the key is recorded first
		findErr error // Find fails
		req     request
		want    Verdict
		finds   int
		reserve int // Reserve, or Begin for atomic
	}{
		{name: "a recorded key replays with a read alone", record: true, req: retried, want: Replayed, finds: 1},
		{name: "a recorded key with another request is reused with a read alone", record: true, req: otherRetried, want: Reused, finds: 1},
		{name: "a new key is read, then reserved", req: retried, want: Executed, finds: 1, reserve: 1},
		{name: "a call not retried is not read first", record: true, req: req, want: Replayed, reserve: 1},
		{name: "a failing read answers without a reservation", req: retried, findErr: errDown, want: StoreUnavailable, finds: 1},
		{name: "a failing read with WithFailOpen still reserves", opts: []Option{WithFailOpen()}, req: retried, findErr: errDown, want: Executed, finds: 1, reserve: 1},
		{name: "a store without store.Finder reserves", plain: true, record: true, req: retried, want: Replayed, reserve: 1},
		{name: "atomic: a recorded key replays without a transaction", atomic: true, record: true, req: retried, want: Replayed, finds: 1},
		{name: "atomic: a failing read answers without a transaction, even with WithFailOpen", opts: []Option{WithFailOpen()}, atomic: true, req: retried, findErr: errDown, want: StoreUnavailable, finds: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, tt.opts...)
			e, op := h.e, h.op
			if tt.plain {
				e = mustEngine(t, plainStore{h.st}, WithLogger(nil))
				op, _ = e.Operation(OperationSpec{Name: opName})
			}
			if tt.atomic {
				op = h.atomic
			}
			if tt.record {
				c := e.newCall(op)
				c.start(t.Context(), req)
				if err := c.record(t.Context(), []byte("outcome-1"), true); c.Verdict != Executed || err != nil {
					t.Fatalf("first call: %v, %v", c.Verdict, err)
				}
			}
			h.st.fail(mFind, tt.findErr, 1)
			h.st.resetCounts()
			c := e.newCall(op)
			c.start(t.Context(), tt.req)
			if c.Verdict != tt.want {
				t.Fatalf("verdict %v, want %v", c.Verdict, tt.want)
			}
			if c.Verdict == Replayed && string(c.Outcome) != "outcome-1" {
				t.Errorf("Outcome = %q, want outcome-1", c.Outcome)
			}
			wantCount(t, h.st, mFind, tt.finds)
			reserve := mReserve
			if tt.atomic {
				reserve = mBegin
			}
			wantCount(t, h.st, reserve, tt.reserve)
			c.abandon(t.Context())
		})
	}
}

// TestLease checks the lease the store receives for a call's deadline.
func TestLease(t *testing.T) {
	const grace = 5 * time.Second // the grace after a deadline, as the README documents it
	// near reports whether lease is the remaining time, left before and
	// after start, plus grace.
	near := func(lease, before, after time.Duration) bool {
		return lease >= max(after, 0)+grace && lease <= max(before, 0)+grace
	}
	tests := []struct {
		name    string
		opts    []Option
		timeout time.Duration // of the call's context; none if 0
		want    func(lease, before, after time.Duration) bool
	}{{
		name: "no deadline: DefaultLease",
		want: func(l, _, _ time.Duration) bool { return l == DefaultLease },
	}, {
		name: "no deadline: WithLease",
		opts: []Option{WithLease(42 * time.Second)},
		want: func(l, _, _ time.Duration) bool { return l == 42*time.Second },
	}, {
		name: "no deadline: WithLease at most DefaultMaxLease",
		opts: []Option{WithLease(time.Hour)},
		want: func(l, _, _ time.Duration) bool { return l == DefaultMaxLease },
	}, {
		name: "no deadline: WithLease at most WithMaxLease",
		opts: []Option{WithLease(2 * time.Minute), WithMaxLease(time.Minute)},
		want: func(l, _, _ time.Duration) bool { return l == time.Minute },
	}, {
		name:    "a deadline: the time left plus the grace",
		timeout: 30 * time.Second,
		want:    near,
	}, {
		name:    "a deadline: the time left plus the grace, WithLease aside",
		opts:    []Option{WithLease(time.Second)},
		timeout: 30 * time.Second,
		want:    near,
	}, {
		name:    "a deadline: at most DefaultMaxLease",
		timeout: time.Hour,
		want:    func(l, _, _ time.Duration) bool { return l == DefaultMaxLease },
	}, {
		name:    "a deadline: at most WithMaxLease, grace included",
		opts:    []Option{WithMaxLease(time.Minute)},
		timeout: time.Minute - time.Second,
		want:    func(l, _, _ time.Duration) bool { return l == time.Minute },
	}, {
		name:    "a deadline of 1ns: the grace",
		timeout: time.Nanosecond,
		want:    near,
	}, {
		name:    "the largest deadline: DefaultMaxLease",
		timeout: math.MaxInt64,
		want:    func(l, _, _ time.Duration) bool { return l == DefaultMaxLease },
	}, {
		name:    "the largest deadline with the largest WithMaxLease: no overflow",
		opts:    []Option{WithMaxLease(math.MaxInt64), WithRetention(math.MaxInt64)},
		timeout: math.MaxInt64,
		want:    func(l, _, _ time.Duration) bool { return l == math.MaxInt64 },
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, tt.opts...)
			ctx := t.Context()
			if tt.timeout != 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.timeout)
				defer cancel()
			}
			deadline, hasDeadline := ctx.Deadline()
			before := time.Until(deadline)
			h.start(ctx, h.op, req) // the fake ignores ctx: it reserves, done or not
			after := time.Until(deadline)
			lease := h.st.lastReceived(t).Lease
			if lease <= 0 {
				t.Fatalf("lease %v, want above zero", lease)
			}
			if !hasDeadline {
				before, after = 0, 0
			}
			if !tt.want(lease, before, after) {
				t.Errorf("lease %v; the deadline was %v away before Start and %v after", lease, before, after)
			}
		})
	}
}

// TestScope checks which calls share a key: by default those of one tenant
// and operation; with ScopeTenant those of one tenant, and a key used on a
// second operation is reused.
func TestScope(t *testing.T) {
	newOp := func(t *testing.T, e *Engine, name string) *Operation {
		op, err := e.Operation(OperationSpec{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		return op
	}
	h := newHarness(t)
	refund := newOp(t, h.e, "/test.v1.Payments/Refund")
	h.recorded(t, h.op, req, "outcome-1")
	h.executed(t, refund, req)
	h.executed(t, h.op, request{Tenant: "tenant-b", Key: req.Key, Fingerprint: req.Fingerprint})

	h = newHarness(t, WithScope(ScopeTenant))
	refund = newOp(t, h.e, "/test.v1.Payments/Refund")
	h.recorded(t, h.op, req, "outcome-1")
	if c := h.start(t.Context(), refund, req); c.Verdict != Reused {
		t.Errorf("ScopeTenant, the key on a second operation: verdict %v, want reused", c.Verdict)
	}
	if c := h.start(t.Context(), h.op, req); c.Verdict != Replayed {
		t.Errorf("ScopeTenant, the key on its operation: verdict %v, want replayed", c.Verdict)
	}
	h.executed(t, refund, request{Tenant: "tenant-b", Key: req.Key, Fingerprint: req.Fingerprint})
}

// TestReservationBounds checks that every reservation says how large its
// outcome may be (WithMaxRecordSize), so that a store with bounds sets that
// room aside, and names the call's tenant by its partition alone, in both
// modes and in every poll of a waiting duplicate.
func TestReservationBounds(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
		want int
	}{
		{"default", nil, DefaultMaxRecordSize},
		{"WithMaxRecordSize", []Option{WithMaxRecordSize(64 << 10)}, 64 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, append(tc.opts, WithInProgressWait(100*time.Millisecond))...)
			h.executed(t, h.op, req)
			h.start(t.Context(), h.op, req) // waits, reserving again
			h.start(t.Context(), h.atomic, request{Tenant: req.Tenant, Key: "key-2", Fingerprint: req.Fingerprint}).release(t.Context())
			h.executed(t, h.op, request{Key: "key-3", Fingerprint: req.Fingerprint})
			h.st.mu.Lock()
			received := slices.Clone(h.st.received)
			h.st.mu.Unlock()
			if len(received) < 4 {
				t.Fatalf("%d reservations received, want the first call's, the duplicate's polls, the atomic call's and the tenantless one", len(received))
			}
			tenantless := received[len(received)-1]
			for _, r := range received[:len(received)-1] {
				if r.MaxOutcome != tc.want || r.Partition != store.TenantPartition(req.Tenant) {
					t.Errorf("reservation with MaxOutcome %d and partition %x; want %d and the tenant's %x", r.MaxOutcome, r.Partition, tc.want, store.TenantPartition(req.Tenant))
				}
			}
			if tenantless.Partition != (store.Partition{}) || tenantless.MaxOutcome != tc.want {
				t.Errorf("a call without a tenant: partition %x, MaxOutcome %d; want the zero partition and %d", tenantless.Partition, tenantless.MaxOutcome, tc.want)
			}
		})
	}
	if store.TenantPartition("tenant-a") == store.TenantPartition("tenant-b") || store.TenantPartition("tenant-a") == (store.Partition{}) {
		t.Error("two tenants share a partition, or a tenant has the zero one")
	}
}

// TestLogsHoldNoRawKeyOrTenant runs every path that logs, with a distinctive
// key and tenant, and checks that neither appears in the log.
func TestLogsHoldNoRawKeyOrTenant(t *testing.T) {
	const (
		rawKey    = "KEY-zebra-crossing-8841"
		rawTenant = "TENANT-okapi-3317"
	)
	var logs *logtest.Buffer
	logger := newLogger(t, &logs)
	ctx := t.Context()
	n := 0
	// call starts a call with a key of its own on a new engine, and ends it.
	serveOne := func(t *testing.T, atomic bool, prepare func(st *fakeStore), run func(c *call), opts ...Option) *fakeStore {
		t.Helper()
		st := newFakeStore()
		e := mustEngine(t, st, append([]Option{WithLogger(logger)}, opts...)...)
		op, err := e.Operation(OperationSpec{Name: opName, Atomic: atomic})
		if err != nil {
			t.Fatal(err)
		}
		if prepare != nil {
			prepare(st)
		}
		n++
		c := e.newCall(op)
		c.start(ctx, request{Tenant: rawTenant, Key: fmt.Sprintf("%s-%d", rawKey, n), Fingerprint: fingerprint("request-1"), Retried: true})
		if run != nil {
			run(&c)
		}
		c.end(ctx, 0)
		return st
	}
	record := func(outcome []byte) func(c *call) {
		return func(c *call) { _ = c.record(ctx, outcome, true) }
	}
	failing := func(method string, err error) func(st *fakeStore) {
		return func(st *fakeStore) { st.fail(method, err, 1) }
	}
	full := fmt.Errorf("fake store: %w", store.ErrFull)
	lost := fmt.Errorf("fake store: %w", store.ErrLeaseLost)

	serveOne(t, false, nil, record([]byte("outcome")))
	serveOne(t, false, failing(mFind, errDown), nil)
	serveOne(t, false, failing(mReserve, errDown), nil)
	serveOne(t, false, failing(mReserve, errDown), nil, WithFailOpen())
	serveOne(t, false, failing(mReserve, full), nil)
	serveOne(t, false, nil, record(bytes.Repeat([]byte("x"), 2049)), WithMaxRecordSize(2048))
	serveOne(t, false, failing(mComplete, full), record([]byte("outcome")))
	serveOne(t, false, failing(mComplete, lost), record([]byte("outcome")))
	serveOne(t, false, failing(mRelease, errDown), func(c *call) { c.release(ctx) })
	serveOne(t, true, failing(mCommit, errDown), record([]byte("outcome")))
	serveOne(t, true, failing(mRollback, errDown), func(c *call) { c.release(ctx) })
	background := serveOne(t, false, failing(mComplete, errDown), record([]byte("outcome")))
	eventually(t, "the background record", func() bool {
		return background.count(mComplete) >= 2 && strings.Contains(logs.String(), "complete succeeded in the background")
	})

	out := logs.String()
	for _, want := range []string{
		"level=DEBUG", "find failed", "reserve failed", "unprotected", "store is full", "exceeds the limit",
		"complete refused", "lease was taken over", "release failed", "commit failed", "rollback failed",
		"complete succeeded in the background", "scope=", opName,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the log holds no %q", want)
		}
	}
	for _, raw := range []string{rawKey, rawTenant} {
		if strings.Contains(out, raw) {
			t.Errorf("the log holds the raw %q:\n%s", raw, out)
		}
	}
}

// mustEngine is New on st with opts, for one tenant.
func mustEngine(t testing.TB, st store.Store, opts ...Option) *Engine {
	t.Helper()
	e, err := New(st, append([]Option{WithSingleTenant()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// A mistake in the options fails New, with an error that names the fix,
// rather than turn into a default in silence.
func TestNewRefusesMistakes(t *testing.T) {
	for name, tc := range map[string]struct {
		st   store.Store
		opts []Option
		want string
	}{
		"nil store":                 {nil, nil, "needs a store"},
		"negative lease":            {newFakeStore(), []Option{WithLease(-time.Second)}, "WithLease(-1s): the duration must be positive"},
		"zero lease":                {newFakeStore(), []Option{WithLease(0)}, "WithLease(0s)"},
		"zero maximum lease":        {newFakeStore(), []Option{WithMaxLease(0)}, "WithMaxLease(0s)"},
		"negative retention":        {newFakeStore(), []Option{WithRetention(-1)}, "WithRetention(-1ns)"},
		"zero retention":            {newFakeStore(), []Option{WithRetention(0)}, "WithRetention(0s)"},
		"zero retry after":          {newFakeStore(), []Option{WithMaxRetryAfter(0)}, "WithMaxRetryAfter(0s)"},
		"negative in-progress wait": {newFakeStore(), []Option{WithInProgressWait(-time.Second)}, "WithInProgressWait(-1s)"},
		"negative clock skew":       {newFakeStore(), []Option{WithClockSkew(-time.Second)}, "WithClockSkew(-1s)"},
		"record size below a reply": {newFakeStore(), []Option{WithMaxRecordSize(10)}, "MinRecordSize"},
		"retention under the lease": {newFakeStore(), []Option{WithRetention(time.Minute), WithMaxLease(time.Hour)}, "shorter than the longest lease"},
		"nil tenant function":       {newFakeStore(), []Option{WithTenant(nil)}, "WithTenant(nil)"},
		"region not a name":         {newFakeStore(), []Option{WithRegion("EU West")}, "WithRegion"},
		"no region":                 {newFakeStore(), []Option{WithRegion("")}, "WithRegion"},
		"one tenant and many":       {newFakeStore(), []Option{WithTenant(func(context.Context) (string, error) { return "", nil }), WithSingleTenant()}, "contradict"},
	} {
		t.Run(name, func(t *testing.T) {
			if e, err := New(tc.st, tc.opts...); e != nil || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, %v; want an error naming %q", e, err, tc.want)
			}
		})
	}
	e, err := New(newFakeStore())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Operation(OperationSpec{Name: opName}); err == nil || !strings.Contains(err.Error(), "engine.WithSingleTenant") {
		t.Errorf("an operation of an engine with no tenant: %v, want an error naming engine.WithTenant and engine.WithSingleTenant", err)
	}
	if _, err := e.Operation(OperationSpec{Name: opName, OwnTenant: true}); err != nil {
		t.Errorf("an operation that reads its own tenant: %v", err)
	}
}
