package example_test

import (
	"context"
	"time"

	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// savedOrder is what a client keeps with an order: its idempotency key, when
// it first sent it, and the region the first attempt went to.
type savedOrder struct {
	Key         string
	FirstSent   time.Time
	FirstRegion string
}

// failOver is docs/regions.md's client snippet, between the markers
// (TestREADMESnippets): a retry in another region with the saved key.
func failOver(ctx context.Context, payments paymentsv1.PaymentServiceClient, req *paymentsv1.CreateChargeRequest, order savedOrder) error {
	// readme:regions-client
	// The key and first-sent time saved with the order, and the region its
	// first attempt went to.
	_, err := payments.CreateCharge(ctx, req,
		interceptor.UseKeyFirstRegion(order.Key, order.FirstSent, order.FirstRegion))
	// end readme
	return err
}

var _ = failOver
