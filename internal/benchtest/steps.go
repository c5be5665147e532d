package benchtest

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// StepWrites measures, interleaved, what a step and a lease's renewal cost
// a store that implements store.Stepper and store.Renewer: a first call's
// writes (Reserve, then Complete), the same with one step between them
// (StartStep before it, FinishStep after), and one Renew of a held key. It
// reports each one's time and the ratios to the first call.
func StepWrites(b *testing.B, st store.Store) {
	steps, ok := st.(store.Stepper)
	renewer, ok2 := st.(store.Renewer)
	if !ok || !ok2 {
		b.Fatalf("%T does not implement store.Stepper and store.Renewer", st)
	}
	ctx := context.Background()
	run := strconv.FormatInt(time.Now().UnixNano(), 36) // keys of no earlier run
	fp := store.Fingerprint{1}
	reserve := func(prefix string, i int) (store.Key, store.Token, error) {
		key := store.ScopeKey("tenant", "/bench.v1.Bench/Call", run+prefix+strconv.Itoa(i))
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: time.Hour,
			MaxOutcome: store.SmallOutcome})
		if err == nil && res.State != store.Acquired {
			err = fmt.Errorf("reserve of a new key: %v", res.State)
		}
		return key, res.Token, err
	}
	outcome, result := []byte("a recorded reply"), []byte(`{"id":"ch_1"}`)
	held, token, err := reserve("held", 0)
	if err != nil {
		b.Fatal(err)
	}
	ns := Interleave(b,
		Op{Name: "first", Run: func(i int) error {
			key, token, err := reserve("first", i)
			if err != nil {
				return err
			}
			return st.Complete(ctx, key, token, outcome)
		}},
		Op{Name: "first-with-step", Run: func(i int) error {
			key, token, err := reserve("step", i)
			if err != nil {
				return err
			}
			if _, err := steps.StartStep(ctx, store.StepStart{Key: key, Name: "charge", Token: token, Fingerprint: fp}); err != nil {
				return err
			}
			if err := steps.FinishStep(ctx, key, token, "charge", result); err != nil {
				return err
			}
			return st.Complete(ctx, key, token, outcome)
		}},
		Op{Name: "renew", Run: func(int) error { return renewer.Renew(ctx, held, token, time.Minute) }},
	)
	b.ReportMetric(ns[1]/ns[0], "with-step/first")
	b.ReportMetric(ns[2]/ns[0], "renew/first")
}
