package redis

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkey/idemkey/store"
)

// The steps of a run (store.Stepper) and its lease's renewal
// (store.Renewer), each one script (scripts.go) fenced by the run's token.
// Token 0 stands for a run that holds its key by an open store.Atomic
// transaction; this store has none, so such a token holds nothing here and
// is fenced out (store.ErrLeaseLost) before any round trip.

// stepKeys returns the KEYS of a step script on key: the record's, then
// the hash of its steps, which shares the record's hash tag and so its slot.
func (s *Store) stepKeys(key store.Key) ([]string, int) {
	keys, slot := s.keys(key)
	return append(keys, keys[0]+":steps"), slot
}

// fencedOut is the error of a call whose token does not hold the key.
func fencedOut(op string) error { return fmt.Errorf("idemkey redis: %s: %w", op, store.ErrLeaseLost) }

// StartStep implements store.Stepper with one script. With WithReplicas, a
// step started but not confirmed in time is forgotten again, as Reserve
// frees its key: it never ran, and its next run need not ask about it.
func (s *Store) StartStep(ctx context.Context, st store.StepStart) (store.StepEntry, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "start step"); err != nil {
		return store.StepEntry{}, err
	}
	if st.Token == 0 {
		return store.StepEntry{}, fencedOut("start step")
	}
	token := strconv.FormatInt(int64(st.Token), 10)
	keys, slot := s.stepKeys(st.Key)
	v, err := s.run(ctx, "start step", startStepScript, keys, slot, writeCount, token, st.Name, st.Fingerprint[:])
	a, _ := v.([]any)
	if err != nil {
		if errors.Is(err, errNotReplicated) && len(a) > 0 && a[0] == int64(1) {
			_ = s.ForgetSteps(ctx, st.Key, st.Token, st.Name)
		}
		return store.StepEntry{}, err
	}
	if len(a) == 2 && a[0] == int64(0) {
		return store.StepEntry{}, fencedOut("start step")
	}
	if len(a) != 4 {
		return store.StepEntry{}, errors.New("idemkey redis: start step: the script's reply has an unexpected shape")
	}
	kind, _ := a[0].(int64)
	fp, _ := a[2].(string)
	result, _ := a[3].(string)
	var res store.StepEntry
	switch kind {
	case 1:
		res.State = store.StepNew
		return res, nil
	case 2:
		res.State = store.StepStarted
	case 3:
		res.State, res.Result = store.StepDone, []byte(result)
	default:
		return store.StepEntry{}, errors.New("idemkey redis: start step: the script's reply has an unexpected shape")
	}
	copy(res.Fingerprint[:], fp)
	return res, nil
}

// FinishStep implements store.Stepper with one script, detached from ctx's
// cancellation like Complete: the step's effect has taken place, and a
// caller that hangs up must not leave it unknown.
func (s *Store) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if err := s.admit(ctx, "finish step"); err != nil {
		return err
	}
	if token == 0 {
		return fencedOut("finish step")
	}
	keys, slot := s.stepKeys(key)
	return s.write(ctx, "finish step", finishStepScript, keys, slot, writeCount, strconv.FormatInt(int64(token), 10), name, result)
}

// ForgetSteps implements store.Stepper with one script.
func (s *Store) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "forget steps"); err != nil {
		return err
	}
	if token == 0 {
		return fencedOut("forget steps")
	}
	args := make([]any, 0, 1+len(names))
	args = append(args, strconv.FormatInt(int64(token), 10))
	for _, name := range names {
		args = append(args, name)
	}
	keys, slot := s.stepKeys(key)
	return s.write(ctx, "forget steps", forgetStepsScript, keys, slot, uncounted, args...)
}

// Renew implements store.Renewer with one script, on the server's clock.
func (s *Store) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "renew"); err != nil {
		return err
	}
	if token == 0 {
		return fencedOut("renew")
	}
	keys, slot := s.keys(key)
	return s.write(ctx, "renew", renewScript, keys, slot, writeCount, strconv.FormatInt(int64(token), 10), micros(lease))
}
