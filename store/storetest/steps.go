package storetest

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// The tests of store.Stepper and store.Renewer, skipped for a store that
// implements neither.

func startStep(t *testing.T, st store.Stepper, key store.Key, token store.Token, name string, fp store.Fingerprint) store.StepEntry {
	t.Helper()
	res, err := st.StartStep(tenantContext(), store.StepStart{Key: key, Name: name, Token: token, Fingerprint: fp, Retention: retention})
	if err != nil {
		t.Fatalf("StartStep(%s): %v", name, err)
	}
	return res
}

func finishStep(t *testing.T, st store.Stepper, key store.Key, token store.Token, name, result string) {
	t.Helper()
	if err := st.FinishStep(tenantContext(), key, token, name, []byte(result)); err != nil {
		t.Fatalf("FinishStep(%s): %v", name, err)
	}
}

func wantStep(t *testing.T, res store.StepEntry, state store.StepState, result string) {
	t.Helper()
	if res.State != state || string(res.Result) != result {
		t.Fatalf("step = state %d, result %q; want state %d, result %q", res.State, res.Result, state, result)
	}
}

// testSteps: a step is started once, and its result is found by the key's
// next run after a release, whatever its token.
func testSteps(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	wantStep(t, startStep(t, st, key, first, "charge", fpA), store.StepNew, "")
	wantStep(t, startStep(t, st, key, first, "charge", fpA), store.StepStarted, "")
	finishStep(t, st, key, first, "charge", "ch_0")
	finishStep(t, st, key, first, "charge", "ch_1") // a retried write replaces it
	wantStep(t, startStep(t, st, key, first, "email", fpA), store.StepNew, "")
	if err := h.Store.Release(tenantContext(), key, first); err != nil {
		t.Fatalf("Release: %v", err)
	}

	second := mustAcquire(t, h.Store, key, fpA)
	res := startStep(t, st, key, second, "charge", fpA)
	wantStep(t, res, store.StepDone, "ch_1")
	if res.Fingerprint != fpA {
		t.Errorf("step's fingerprint = %x, want the request's %x", res.Fingerprint[:4], fpA[:4])
	}
	wantStep(t, startStep(t, st, key, second, "email", fpA), store.StepStarted, "")
	wantStep(t, startStep(t, st, newKey(t, "other"), mustAcquire(t, h.Store, newKey(t, "other"), fpA), "charge", fpA), store.StepNew, "")
}

// testStepsOtherRequest: a step keeps the fingerprint of the request it
// was recorded for, for the engine to refuse a key reused after a release.
func testStepsOtherRequest(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	startStep(t, st, key, first, "charge", fpA)
	finishStep(t, st, key, first, "charge", "ch_1")
	if err := h.Store.Release(tenantContext(), key, first); err != nil {
		t.Fatalf("Release: %v", err)
	}
	res := startStep(t, st, key, mustAcquire(t, h.Store, key, fpB), "charge", fpB)
	wantStep(t, res, store.StepDone, "ch_1")
	if res.Fingerprint != fpA {
		t.Errorf("step's fingerprint = %x, want the first request's %x", res.Fingerprint[:4], fpA[:4])
	}
}

// testStepsFenced: a run whose lease was taken over writes no step, and
// the new run finds the old one's step started.
func testStepsFenced(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	ctx := tenantContext()
	key := newKey(t, "k")
	first := mustAcquire(t, h.Store, key, fpA)
	startStep(t, st, key, first, "charge", fpA)
	h.Advance(t, lease+time.Second)
	second := mustAcquire(t, h.Store, key, fpA)

	_, err := st.StartStep(ctx, store.StepStart{Key: key, Name: "email", Token: first, Fingerprint: fpA, Retention: retention})
	wantLeaseLost(t, "StartStep", err)
	wantLeaseLost(t, "FinishStep", st.FinishStep(ctx, key, first, "charge", []byte("late")))
	wantLeaseLost(t, "ForgetSteps", st.ForgetSteps(ctx, key, first))
	_, err = st.StartStep(ctx, store.StepStart{Key: newKey(t, "absent"), Name: "charge", Token: first, Fingerprint: fpA, Retention: retention})
	wantLeaseLost(t, "StartStep of a key not held", err)

	wantStep(t, startStep(t, st, key, second, "charge", fpA), store.StepStarted, "")
	wantStep(t, startStep(t, st, key, second, "email", fpA), store.StepNew, "")
	complete(t, h.Store, key, second, []byte("done"))
	wantLeaseLost(t, "FinishStep after Complete", st.FinishStep(ctx, key, second, "charge", []byte("late")))
}

// testFinishUnstarted: a result is recorded only for a started step.
func testFinishUnstarted(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	wantLeaseLost(t, "FinishStep of a step never started", st.FinishStep(tenantContext(), key, token, "charge", []byte("x")))
	wantStep(t, startStep(t, st, key, token, "charge", fpA), store.StepNew, "")
}

func testForgetSteps(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	ctx := tenantContext()
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	for _, name := range []string{"a", "b", "c"} {
		startStep(t, st, key, token, name, fpA)
	}
	finishStep(t, st, key, token, "b", "B")
	if err := st.ForgetSteps(ctx, key, token, "a"); err != nil {
		t.Fatalf("ForgetSteps(a): %v", err)
	}
	wantStep(t, startStep(t, st, key, token, "a", fpA), store.StepNew, "")
	wantStep(t, startStep(t, st, key, token, "b", fpA), store.StepDone, "B")
	if err := st.ForgetSteps(ctx, key, token); err != nil {
		t.Fatalf("ForgetSteps(): %v", err)
	}
	for _, name := range []string{"a", "b", "c"} {
		wantStep(t, startStep(t, st, key, token, name, fpA), store.StepNew, "")
	}
}

// testStepsExpire: a step expires with the record it was started under,
// and a Sweeper deletes it with the record.
func testStepsExpire(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	token := reserveFor(t, h.Store, key, fpA, lease, time.Minute).Token
	startStep(t, st, key, token, "charge", fpA)
	finishStep(t, st, key, token, "charge", "ch_1")
	startStep(t, st, key, token, "email", fpA)
	complete(t, h.Store, key, token, []byte("done"))
	h.Advance(t, time.Minute+time.Second)

	if sweeper, ok := h.Store.(store.Sweeper); ok {
		deleted, err := sweeper.Sweep(tenantContext(), 100)
		if err != nil || deleted != 3 {
			t.Errorf("Sweep = %d, %v; want 3 (the record and its two steps), nil", deleted, err)
		}
	}
	again := mustAcquire(t, h.Store, key, fpA)
	wantStep(t, startStep(t, st, key, again, "charge", fpA), store.StepNew, "")
	wantStep(t, startStep(t, st, key, again, "email", fpA), store.StepNew, "")
}

// testStepsAtomic: in an open transaction's run (token 0) a step needs no
// record of the key, and lives its own retention.
func testStepsAtomic(t *testing.T, h Harness) {
	need[store.Atomic](t, h)
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	start := store.StepStart{Key: key, Name: "charge", Fingerprint: fpA, Retention: time.Minute}
	res, err := st.StartStep(tenantContext(), start)
	if err != nil || res.State != store.StepNew {
		t.Fatalf("StartStep without a record = %+v, %v; want StepNew", res, err)
	}
	finishStep(t, st, key, 0, "charge", "ch_1")
	wantStep(t, startStep(t, st, key, 0, "charge", fpA), store.StepDone, "ch_1")
	h.Advance(t, time.Minute+time.Second)
	wantStep(t, startStep(t, st, key, 0, "charge", fpA), store.StepNew, "")
}

// testConcurrentStartStep: of the calls that start one step at once,
// exactly one is told StepNew.
func testConcurrentStartStep(t *testing.T, h Harness) {
	st := need[store.Stepper](t, h)
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	const n = 16
	var wg sync.WaitGroup
	states := make([]store.StepState, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			var res store.StepEntry
			res, errs[i] = st.StartStep(tenantContext(), store.StepStart{Key: key, Name: "charge", Token: token, Fingerprint: fpA, Retention: retention})
			states[i] = res.State
		})
	}
	wg.Wait()
	news := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("StartStep: %v", errs[i])
		}
		if states[i] == store.StepNew {
			news++
		}
	}
	if news != 1 {
		t.Errorf("%d of %d concurrent StartSteps were told StepNew, want 1", news, n)
	}
}

// testRenew: a renewed lease is not taken over until it ends; a stale
// token renews nothing.
func testRenew(t *testing.T, h Harness) {
	r := need[store.Renewer](t, h)
	ctx := tenantContext()
	key := newKey(t, "k")
	token := mustAcquire(t, h.Store, key, fpA)
	h.Advance(t, lease*8/10)
	if err := r.Renew(ctx, key, token, lease); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	h.Advance(t, lease*8/10) // past the first lease, inside the renewed one
	res := reserve(t, h.Store, key, fpA)
	wantState(t, res, store.Held)
	if res.RetryAfter > lease*3/10 || res.RetryAfter <= 0 {
		t.Errorf("Held's RetryAfter = %v, want what the renewed lease has left, about %v", res.RetryAfter, lease*2/10)
	}
	h.Advance(t, lease*3/10)
	second := mustAcquire(t, h.Store, key, fpA)
	wantLeaseLost(t, "Renew of a lease taken over", r.Renew(ctx, key, token, lease))
	complete(t, h.Store, key, second, []byte("done"))
	wantLeaseLost(t, "Renew after Complete", r.Renew(ctx, key, second, lease))
	if err := r.Renew(ctx, newKey(t, "absent"), second, lease); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("Renew of an absent key: err = %v, want ErrLeaseLost", err)
	}
}
