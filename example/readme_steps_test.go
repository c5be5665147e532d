package example_test

// This file is docs/steps.md's snippet, between the markers; the page's copy
// must match it (TestREADMESnippets).

import (
	"context"
	"errors"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// cardProcessor stands for a processor's client, as example.Processor's
// (processor.go) is.
type cardProcessor struct{}

// errRefused is a charge the processor refused before charging.
var errRefused = errors.New("the processor refused the charge")

func (cardProcessor) Charge(ctx context.Context, c *paymentsv1.Charge, key string) (string, error) {
	return "pch_1", nil
}

func (cardProcessor) Find(ctx context.Context, key string) (id string, found bool, err error) {
	return "pch_1", true, nil
}

// readme:steps
// chargeCard charges the card as a step of the handler whose ctx it is:
// a retry of the key gets the processor's id back rather than charge again.
func chargeCard(ctx context.Context, p cardProcessor, c *paymentsv1.Charge) (string, error) {
	return engine.Step(ctx, "charge-card",
		func(ctx context.Context) (string, error) {
			key, _, _ := idemkey.KeyFromContext(ctx) // the step's derived key
			id, err := p.Charge(ctx, c, key)
			if errors.Is(err, errRefused) { // surely not charged: the next run charges
				return "", engine.NotDone(err)
			}
			return id, err // a timeout leaves the step started: the next run reconciles
		},
		func(ctx context.Context) (string, bool, error) {
			key, _, _ := idemkey.KeyFromContext(ctx)
			return p.Find(ctx, key) // done with its id, not done, or an error: cannot tell
		})
}

// end readme

var _ = chargeCard
