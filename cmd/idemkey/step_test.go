package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
)

// startSteps starts each step of names under token, and finishes those
// given a result.
func startSteps(t *testing.T, st store.Stepper, key store.Key, token store.Token, names []string, results map[string]string) {
	t.Helper()
	ctx := context.Background()
	for _, name := range names {
		if _, err := st.StartStep(ctx, store.StepStart{Key: key, Name: name, Token: token, Fingerprint: store.Fingerprint{1, 2, 3}, Retention: time.Hour}); err != nil {
			t.Fatal(err)
		}
		if result, ok := results[name]; ok {
			if err := st.FinishStep(ctx, key, token, name, []byte(result)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// inspect lists a key's steps, with or without its record; resolve-step
// records a started step's result, or deletes it so that the next run runs
// it, and refuses a finished step, a key under a live lease and a result
// that is not JSON.
func TestResolveStep(t *testing.T) {
	url, _, st := newStore(t)
	ctx := context.Background()
	const rawKey = "order-9-charge"
	k := store.ScopeKey("acme", createCharge, rawKey)
	token := reserve(t, st, k, time.Minute)
	startSteps(t, st, k, token, []string{"charge", "email", "ledger"}, map[string]string{"ledger": `{"id":"L1"}`})
	scope := []string{"-tenant", "acme", "-method", createCharge, "-key", rawKey}
	inspect := append([]string{"inspect"}, scope...)
	resolve := func(want int, args ...string) (stdout, stderr string) {
		t.Helper()
		stdout, stderr = mustRun(t, want, url, append(append([]string{"resolve-step"}, scope...), args...)...)
		if strings.Contains(stdout+stderr, rawKey) {
			t.Errorf("resolve-step printed the raw key:\n%s%s", stdout, stderr)
		}
		return stdout, stderr
	}

	stdout, _ := mustRun(t, exitOK, url, inspect...)
	for _, want := range []string{"in_progress", "step charge", "step email", "started", "outcome is unknown",
		`step ledger  done, result of 11 bytes: {"id":"L1"}`} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect does not show %q:\n%s", want, stdout)
		}
	}
	var rec struct {
		State string
		Steps []struct{ Name, State, Result string }
	}
	jsonOf(t, exitOK, url, &rec, inspect...)
	if rec.State != "in_progress" || len(rec.Steps) != 3 || rec.Steps[0].Name != "charge" || rec.Steps[0].State != "started" ||
		rec.Steps[2].State != "done" || rec.Steps[2].Result != `{"id":"L1"}` {
		t.Errorf("inspect -json: %+v", rec)
	}

	_, stderr := resolve(exitRefused, "-step", "charge", "-done", `"ch_1"`)
	if !strings.Contains(stderr, "live lease") {
		t.Errorf("resolve-step under a live lease says %q", stderr)
	}
	if err := st.Release(ctx, k, token); err != nil {
		t.Fatal(err)
	}
	stdout, _ = mustRun(t, exitOK, url, inspect...)
	if !strings.Contains(stdout, "none: released") || !strings.Contains(stdout, "step charge") {
		t.Errorf("inspect of a released key with steps:\n%s", stdout)
	}

	for _, bad := range [][]string{
		{"-step", "charge", "-done", "ch_1"}, // not JSON
		{"-step", "charge"},
		{"-step", "charge", "-done", `"x"`, "-not-done"},
		{"-done", `"x"`},
	} {
		resolve(exitUsage, bad...)
	}
	stdout, _ = resolve(exitOK, "-step", "charge", "-done", `"ch_1"`)
	if !strings.Contains(stdout, `step "charge" of record`) || !strings.Contains(stdout, "resolved done") {
		t.Errorf("resolve-step -done says:\n%s", stdout)
	}
	var res struct {
		Step  string
		Done  bool
		Bytes int
	}
	jsonOf(t, exitOK, url, &res, append(append([]string{"resolve-step"}, scope...), "-step", "email", "-not-done")...)
	if res.Step != "email" || res.Done {
		t.Errorf("resolve-step -not-done -json: %+v", res)
	}
	_, stderr = resolve(exitRefused, "-step", "charge", "-not-done")
	if !strings.Contains(stderr, `step "charge" is finished already`) {
		t.Errorf("resolve-step of a finished step says %q", stderr)
	}
	resolve(exitNotFound, "-step", "email", "-not-done") // deleted
	resolve(exitNotFound, "-step", "refund", "-done", "1")

	next := reserve(t, st, k, time.Minute)
	for name, want := range map[string]store.StepEntry{
		"charge": {State: store.StepDone, Result: []byte(`"ch_1"`)},
		"email":  {State: store.StepNew},
		"ledger": {State: store.StepDone, Result: []byte(`{"id":"L1"}`)},
	} {
		got, err := st.StartStep(ctx, store.StepStart{Key: k, Name: name, Token: next, Fingerprint: store.Fingerprint{1, 2, 3}})
		if err != nil || got.State != want.State || string(got.Result) != string(want.Result) {
			t.Errorf("the next run's StartStep(%s) = %+v, %v; want %+v", name, got, err, want)
		}
	}
}

// A step's result is sealed by resolve-step with -seal-key, under the
// step's own key, as the engine seals it; inspect opens it with the same
// key; and an unsealed result is refused for a key whose steps are sealed.
func TestResolveStepSealed(t *testing.T) {
	url, _, st := newStore(t)
	ctx := context.Background()
	keyFile := writeKey(t, 7)
	raw, err := seal.ReadKeyFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	ring, err := seal.NewKeyRing(raw)
	if err != nil {
		t.Fatal(err)
	}
	k := store.ScopeKey("acme", createCharge, "sealed-steps")
	token := reserve(t, st, k, time.Minute)
	sealed, err := ring.Seal(stepKey(k, "ledger"), []byte(`"L1"`))
	if err != nil {
		t.Fatal(err)
	}
	startSteps(t, st, k, token, []string{"charge", "ledger"}, map[string]string{"ledger": string(sealed)})
	if err := st.Release(ctx, k, token); err != nil {
		t.Fatal(err)
	}
	scope := []string{"-tenant", "acme", "-method", createCharge, "-key", "sealed-steps"}

	_, stderr := mustRun(t, exitUsage, url, append(append([]string{"resolve-step"}, scope...), "-step", "charge", "-done", `"ch_1"`)...)
	if !strings.Contains(stderr, "give -seal-key") {
		t.Errorf("an unsealed result for sealed steps: %q", stderr)
	}
	stdout, _ := mustRun(t, exitOK, url, append(append([]string{"resolve-step"}, scope...), "-step", "charge", "-done", `"ch_1"`, "-seal-key", keyFile)...)
	if !strings.Contains(stdout, "sealed with key "+ring.PrimaryKeyID()) {
		t.Errorf("resolve-step -seal-key says:\n%s", stdout)
	}
	steps, err := st.Steps(ctx, k)
	if err != nil || len(steps) != 2 {
		t.Fatalf("Steps = %+v, %v", steps, err)
	}
	if opened, err := ring.Open(stepKey(k, "charge"), steps[0].Result); err != nil || string(opened) != `"ch_1"` {
		t.Errorf("the resolved result opens under the step's key as %q, %v; want \"ch_1\"", opened, err)
	}

	stdout, _ = mustRun(t, exitOK, url, append([]string{"inspect"}, scope...)...)
	if !strings.Contains(stdout, "give -seal-key to read it") || strings.Contains(stdout, "ch_1") {
		t.Errorf("inspect without the key:\n%s", stdout)
	}
	stdout, _ = mustRun(t, exitOK, url, append(append([]string{"inspect"}, scope...), "-seal-key", keyFile)...)
	for _, want := range []string{`: "ch_1"`, `: "L1"`, "sealed with key " + ring.PrimaryKeyID()} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect -seal-key does not show %q:\n%s", want, stdout)
		}
	}
}
