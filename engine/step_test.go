package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// stepCall is an Exchange of one keyed call whose handler is run: the
// translation an entry point writes, cut to what the steps' tests need.
type stepCall struct {
	key     string
	request string // another request is another fingerprint
	run     func(ctx context.Context) error
	answer  Answer
	ran     bool
}

func (x *stepCall) Key() (string, bool, error) { return x.key, true, nil }
func (x *stepCall) FirstSent() []string        { return nil }
func (x *stepCall) FirstRegion() []string      { return nil }
func (x *stepCall) Attempt() Attempt           { return Attempt{} }
func (x *stepCall) Fingerprint(context.Context) (store.Fingerprint, error) {
	return fingerprint(x.request), nil
}
func (x *stepCall) StandIn(error) []byte { return []byte("stand-in") }
func (x *stepCall) Pass(ctx context.Context) int {
	x.ran = true
	_ = x.run(ctx)
	return 0
}
func (x *stepCall) Answer(_ context.Context, a Answer) int { x.answer = a; return 0 }

// Run records "done" on success, and releases the key on an error.
func (x *stepCall) Run(ctx context.Context) HandlerResult {
	x.ran = true
	if err := x.run(ctx); err != nil {
		return HandlerResult{Release: true}
	}
	return HandlerResult{Record: []byte("done"), KeepWrites: true}
}

// stepEngine is an engine on st with a log, and its two-phase operation.
func stepEngine(t *testing.T, st store.Store, opts ...Option) (*Engine, *Operation) {
	t.Helper()
	var logs *logtest.Buffer
	e := mustEngine(t, st, append([]Option{WithLogger(newLogger(t, &logs))}, opts...)...)
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	return e, op
}

// serve serves one call of op with key, whose handler is run, and returns
// its answer.
func serve(e *Engine, op *Operation, key string, run func(ctx context.Context) error) Answer {
	x := &stepCall{key: key, request: "r", run: run}
	e.Serve(context.Background(), op, x)
	return x.answer
}

// processor counts charges, as a card processor that ignores keys would.
type processor struct {
	charges atomic.Int64
	keys    sync.Map // the key each charge was sent with
}

func (p *processor) charge(ctx context.Context) (string, error) {
	n := p.charges.Add(1)
	key, _, _ := idemkey.KeyFromContext(ctx)
	p.keys.Store(n, key)
	return fmt.Sprintf("ch_%d", n), nil
}

// TestStepRunsOnce: a step's result is recorded as it returns, and every
// later run of the key gets it without running the step.
func TestStepRunsOnce(t *testing.T) {
	e, op := stepEngine(t, memory.New())
	var p processor
	var got []string
	failNext := true
	handler := func(ctx context.Context) error {
		id, err := Step(ctx, "charge", p.charge, nil)
		if err != nil {
			return err
		}
		got = append(got, id)
		if failNext { // the write after the charge fails once, for now
			failNext = false
			return errors.New("database unavailable")
		}
		return nil
	}
	if a := serve(e, op, "k1", handler); a.Verdict != Executed {
		t.Fatalf("first call: %v, want executed (released)", a.Verdict)
	}
	if a := serve(e, op, "k1", handler); a.Verdict != Executed || a.Expires.IsZero() {
		t.Fatalf("retry: %+v, want executed and recorded", a)
	}
	if a := serve(e, op, "k1", handler); a.Verdict != Replayed {
		t.Fatalf("third call: %v, want replayed", a.Verdict)
	}
	if n := p.charges.Load(); n != 1 || strings.Join(got, ",") != "ch_1,ch_1" {
		t.Fatalf("%d charges, the handler got %q; want 1 charge, and its result on both runs", n, got)
	}
	key, _ := p.keys.Load(int64(1))
	if want := idemkey.DeriveKey("", opName, "k1", "charge"); key != want {
		t.Errorf("the step's client key = %q, want DeriveKey of the call's parts and the step's name, %q", key, want)
	}
}

// TestStepNeverBlind: a step an earlier run started and never finished is
// reconciled, or answered OutcomeUnknown, never run again.
func TestStepNeverBlind(t *testing.T) {
	lost := func(p *processor) func(context.Context) (string, error) {
		return func(ctx context.Context) (string, error) {
			p.charge(ctx)
			return "", context.DeadlineExceeded // charged, and the answer was lost
		}
	}
	t.Run("no reconcile", func(t *testing.T) {
		e, op := stepEngine(t, memory.New())
		var p processor
		var stepErr error
		handler := func(ctx context.Context) error {
			_, stepErr = Step(ctx, "charge", lost(&p), nil)
			return nil // a retry that drops the error is answered all the same
		}
		serve(e, op, "k1", func(ctx context.Context) error {
			_, err := Step(ctx, "charge", lost(&p), nil)
			return err // released
		})
		for range 3 {
			if a := serve(e, op, "k1", handler); a.Verdict != OutcomeUnknown {
				t.Fatalf("retry: %v, want outcome_unknown", a.Verdict)
			}
			if !errors.Is(stepErr, ErrOutcomeUnknown) {
				t.Fatalf("Step's error: %v, want ErrOutcomeUnknown", stepErr)
			}
		}
		if n := p.charges.Load(); n != 1 {
			t.Fatalf("%d charges, want 1", n)
		}
	})
	t.Run("reconcile tells", func(t *testing.T) {
		e, op := stepEngine(t, memory.New())
		var p processor
		answer := "cannot tell"
		reconcile := func(ctx context.Context) (string, bool, error) {
			switch answer {
			case "done":
				return "ch_1", true, nil
			case "not done":
				return "", false, nil
			}
			return "", false, errors.New("the processor is down")
		}
		var got string
		handler := func(ctx context.Context) error {
			var err error
			got, err = Step(ctx, "charge", lost(&p), reconcile)
			return err
		}
		serve(e, op, "k1", handler)
		if a := serve(e, op, "k1", handler); a.Verdict != OutcomeUnknown {
			t.Fatalf("reconcile cannot tell: %v, want outcome_unknown", a.Verdict)
		}
		answer = "done"
		if a := serve(e, op, "k1", handler); a.Verdict != Executed || got != "ch_1" {
			t.Fatalf("reconcile done: %v with %q, want executed with the reconciled result", a.Verdict, got)
		}
		if n := p.charges.Load(); n != 1 {
			t.Fatalf("%d charges, want 1", n)
		}
		// Not done runs the step.
		serve(e, op, "k2", handler)
		answer = "not done"
		serve(e, op, "k2", handler)
		if n := p.charges.Load(); n != 3 {
			t.Fatalf("%d charges, want 3: reconcile said the second key's was not done", n)
		}
	})
}

// TestStepNotDone: an error marked NotDone took no effect: the retry runs
// the step again, as it does every step of a call released with
// ForgetSteps.
func TestStepNotDone(t *testing.T) {
	e, op := stepEngine(t, memory.New())
	var p processor
	declined := true
	handler := func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(ctx context.Context) (string, error) {
			if declined {
				return "", NotDone(errors.New("connection refused"))
			}
			return p.charge(ctx)
		}, nil)
		return err
	}
	serve(e, op, "k1", handler)
	declined = false
	if a := serve(e, op, "k1", handler); a.Verdict != Executed || p.charges.Load() != 1 {
		t.Fatalf("retry: %v, %d charges; want executed, 1 charge", a.Verdict, p.charges.Load())
	}

	forget := func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", p.charge, nil); err != nil {
			return err
		}
		ForgetSteps(ctx)
		return errors.New("start over")
	}
	serve(e, op, "k2", forget)
	serve(e, op, "k2", forget)
	if n := p.charges.Load(); n != 3 {
		t.Errorf("%d charges, want 3: ForgetSteps runs the step again", n)
	}
}

// TestStepMistakes: a name used twice, or none, is refused before the
// step runs; outside a keyed call the step runs unrecorded.
func TestStepMistakes(t *testing.T) {
	e, op := stepEngine(t, memory.New())
	var p processor
	serve(e, op, "k1", func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", p.charge, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := Step(ctx, "charge", p.charge, nil); err == nil || !strings.Contains(err.Error(), "used twice") {
			t.Errorf("a name used twice: %v, want it refused", err)
		}
		for _, name := range []string{"", "\xff", strings.Repeat("n", 201)} {
			if _, err := Step(ctx, name, p.charge, nil); err == nil {
				t.Errorf("the name %q: no error", name)
			}
		}
		return nil
	})
	if id, err := Step(context.Background(), "charge", p.charge, nil); err != nil || id != "ch_2" {
		t.Errorf("outside a call: %q, %v; want the step run", id, err)
	}
	if n := p.charges.Load(); n != 2 {
		t.Errorf("%d charges, want 2", n)
	}
}

// finishFails is a memory store whose FinishStep fails while fail is set.
type finishFails struct {
	*memory.Store
	fail atomic.Bool
}

func (s *finishFails) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	if s.fail.Load() {
		return fmt.Errorf("connection reset: %w", store.ErrUnavailable)
	}
	return s.Store.FinishStep(ctx, key, token, name, result)
}

// TestStepStoreFails: a step whose result cannot be recorded leaves it
// started, and the call StoreUnavailable with its key free: the retry
// knows the step may have taken effect.
func TestStepStoreFails(t *testing.T) {
	st := &finishFails{Store: memory.New()}
	e, op := stepEngine(t, st)
	var p processor
	handler := func(ctx context.Context) error {
		_, err := Step(ctx, "charge", p.charge, nil)
		return err
	}
	st.fail.Store(true)
	if a := serve(e, op, "k1", handler); a.Verdict != StoreUnavailable {
		t.Fatalf("first call: %v, want store_unavailable", a.Verdict)
	}
	st.fail.Store(false)
	if a := serve(e, op, "k1", handler); a.Verdict != OutcomeUnknown || p.charges.Load() != 1 {
		t.Fatalf("retry: %v, %d charges; want outcome_unknown, 1 charge", a.Verdict, p.charges.Load())
	}

	// Too large a result alike.
	e, op = stepEngine(t, memory.New(), WithMaxRecordSize(2048))
	huge := func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(context.Context) (string, error) { return strings.Repeat("x", 4096), nil }, nil)
		return err
	}
	if a := serve(e, op, "k1", huge); a.Verdict != StoreUnavailable {
		t.Fatalf("a result too large: %v, want store_unavailable", a.Verdict)
	}
	if a := serve(e, op, "k1", huge); a.Verdict != OutcomeUnknown {
		t.Fatalf("its retry: %v, want outcome_unknown", a.Verdict)
	}
}

// TestStepStoreFull: a store with no room for a step's record answers
// StoreFull, with a retry delay, as it does a new key.
func TestStepStoreFull(t *testing.T) {
	e, op := stepEngine(t, memory.New(memory.WithMaxRecords(1)))
	a := serve(e, op, "k1", func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(context.Context) (string, error) { return "ch_1", nil }, nil)
		return err
	})
	if a.Verdict != StoreFull || a.RetryAfter <= 0 {
		t.Fatalf("a step in a full store: %+v, want store_full with a retry delay", a)
	}
}

// TestStepReused: a key whose steps were recorded for another request is
// answered Reused, even once its record is released.
func TestStepReused(t *testing.T) {
	e, op := stepEngine(t, memory.New())
	var p processor
	handler := func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", p.charge, nil); err != nil {
			return err
		}
		return errors.New("released")
	}
	serve(e, op, "k1", handler)
	x := &stepCall{key: "k1", request: "another request", run: handler}
	e.Serve(context.Background(), op, x)
	if x.answer.Verdict != Reused || p.charges.Load() != 1 {
		t.Fatalf("another request: %v, %d charges; want reused, 1 charge", x.answer.Verdict, p.charges.Load())
	}
}

// TestStepSealed: a step's result is sealed in the store, opens for its
// own key's step, and without the sealer does not open: never run again.
func TestStepSealed(t *testing.T) {
	st := memory.New()
	ring := newTestRing(t, 1)
	e, op := stepEngine(t, st, WithSealer(ring))
	var p processor
	handler := func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", p.charge, nil); err != nil {
			return err
		}
		return errors.New("released")
	}
	serve(e, op, "k1", handler)
	key := store.ScopeKey("", opName, "k1")
	token, err := st.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: fingerprint("r"), Lease: time.Minute, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	res, err := st.StartStep(context.Background(), store.StepStart{Key: key, Name: "charge", Token: token.Token, Fingerprint: fingerprint("r"), Retention: time.Hour})
	if err != nil || res.State != store.StepDone || strings.Contains(string(res.Result), "ch_1") {
		t.Fatalf("the stored step = %+v, %v; want done, and sealed", res, err)
	}
	if err := st.Release(context.Background(), key, token.Token); err != nil {
		t.Fatal(err)
	}
	serve(e, op, "k1", handler)
	if n := p.charges.Load(); n != 1 {
		t.Fatalf("%d charges, want 1: the sealed result opens", n)
	}
	unsealed, op2 := stepEngine(t, st)
	if a := serve(unsealed, op2, "k1", handler); a.Verdict != StoreUnavailable || p.charges.Load() != 1 {
		t.Fatalf("without the sealer: %v, %d charges; want store_unavailable, 1 charge", a.Verdict, p.charges.Load())
	}
}

// TestStepAtomic: in atomic mode a step is recorded outside the call's
// transaction, as the transaction's holder (token 0): a rolled-back run
// keeps it.
func TestStepAtomic(t *testing.T) {
	st := newFakeStore()
	e := mustEngine(t, st)
	op, err := e.Operation(OperationSpec{Name: opName, Atomic: true})
	if err != nil {
		t.Fatal(err)
	}
	var p processor
	fail := true
	handler := func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", p.charge, nil); err != nil {
			return err
		}
		if !write(ctx, "charge row") {
			t.Error("the handler's context has no transaction")
		}
		if fail {
			fail = false
			return errors.New("rolled back")
		}
		return nil
	}
	serve(e, op, "k1", handler)
	if a := serve(e, op, "k1", handler); a.Verdict != Executed || p.charges.Load() != 1 {
		t.Fatalf("retry: %v, %d charges; want executed, 1 charge", a.Verdict, p.charges.Load())
	}
	if w := st.committedWrites(); len(w) != 1 {
		t.Errorf("committed writes %q, want the retry's one row", w)
	}
}

// renewCounter is a memory store that counts Renew calls.
type renewCounter struct {
	*memory.Store
	renewals atomic.Int64
}

func (s *renewCounter) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	s.renewals.Add(1)
	return s.Store.Renew(ctx, key, token, lease)
}

// TestLeaseRenewed: a handler that runs three times its lease while its
// duplicates keep coming is never taken over, at about one renewal per
// lease; a call shorter than half its lease renews nothing.
func TestLeaseRenewed(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	st := &renewCounter{Store: memory.New()}
	e, op := stepEngine(t, st, WithLease(lease), WithInProgressWait(0))
	var runs atomic.Int64
	slow := func(context.Context) error {
		runs.Add(1)
		time.Sleep(3 * lease)
		return nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		serve(e, op, "k1", slow)
	}()
	eventually(t, "the first run to start", func() bool { return runs.Load() == 1 })
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				if a := serve(e, op, "k1", slow); a.Verdict != InProgress && a.Verdict != Replayed {
					t.Errorf("a duplicate: %v, want in_progress or replayed", a.Verdict)
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	// Renewals at 0.5, 1.5 and 2.5 leases; a slow machine may add one.
	if n := st.renewals.Load(); n < 2 || n > 5 {
		t.Errorf("%d renewals over 3 leases, want about 3", n)
	}
	st.renewals.Store(0)
	serve(e, op, "k2", func(context.Context) error { return nil })
	if n := st.renewals.Load(); n != 0 {
		t.Errorf("a short call renewed %d times, want 0", n)
	}
}
