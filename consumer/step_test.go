package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
)

// TestStepOutcomeUnknown: a message whose step an earlier delivery started
// and never finished is never acknowledged unrun: each redelivery is held
// (a nak with backoff) while its outcome is unknown, and the last is
// dead-lettered; a step whose result was recorded is not run again.
func TestStepOutcomeUnknown(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		var charges atomic.Int64
		lost := func(ctx context.Context) error {
			_, err := engine.Step(ctx, "charge", func(context.Context) (string, error) {
				charges.Add(1)
				return "", errors.New("the processor's answer was lost")
			}, nil)
			return err
		}
		if res := c.handle(t.Context(), delivery("msg-secret-id", 1), lost); res.Outcome != consumer.Retry || res.Action != consumer.Nak {
			t.Fatalf("first delivery: %+v, want retry with a nak", res)
		}
		for attempt := 2; attempt <= 3; attempt++ {
			res := c.handle(t.Context(), delivery("msg-secret-id", attempt), lost)
			if res.Action != consumer.Nak || res.DeadLetter || !errors.Is(res.Err, engine.ErrOutcomeUnknown) || res.Delay <= 0 {
				t.Fatalf("delivery %d: %+v, want a nak with backoff for an unknown outcome", attempt, res)
			}
		}
		last := delivery("msg-secret-id", 4)
		last.Last = true
		if res := c.handle(t.Context(), last, lost); !res.DeadLetter || !errors.Is(res.Err, engine.ErrOutcomeUnknown) {
			t.Fatalf("last delivery: %+v, want it dead-lettered with the unknown outcome", res)
		}
		if n := charges.Load(); n != 1 {
			t.Fatalf("the step ran %d times, want 1", n)
		}

		// A recorded step is kept for the redelivery of a transient failure.
		fails := true
		kept := func(ctx context.Context) error {
			if _, err := engine.Step(ctx, "charge", func(context.Context) (string, error) {
				charges.Add(1)
				return "ch_1", nil
			}, nil); err != nil {
				return err
			}
			if fails {
				fails = false
				return errors.New("the ledger is down")
			}
			return nil
		}
		c.handle(t.Context(), delivery("msg-2", 1), kept)
		if res := c.handle(t.Context(), delivery("msg-2", 2), kept); res.Outcome != consumer.Processed || charges.Load() != 2 {
			t.Fatalf("redelivery: %+v after %d charges, want processed after 2", res, charges.Load())
		}
	})
}
