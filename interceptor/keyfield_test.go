package interceptor_test

import (
	"context"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// TestKeyField covers AIP-155: the key in the request's request_id, or in
// the metadata, names one operation either way.
func TestKeyField(t *testing.T) {
	svc := newService()
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(memory.New(),
		engine.WithTenant(tenantFromMetadata), interceptor.WithKeyField("request_id"), engine.WithKeyRequired())))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := grpctest.Serve(t, srv)
	// The client interceptor, told of the field too, sends no key of its
	// own with a request that carries one.
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis,
		grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor(interceptor.WithKeyField("request_id"))))))
	plain := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis))
	ctx := metadata.AppendToOutgoingContext(t.Context(), "tenant", "acme")
	withID := func(amount int64, id string) *paymentsv1.CreateChargeRequest {
		req := request(amount)
		req.RequestId = id
		return req
	}
	create := func(c paymentsv1.PaymentServiceClient, ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
		var trailer metadata.MD
		charge, err := c.CreateCharge(ctx, req, grpc.Trailer(&trailer))
		return charge, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), err
	}

	first, replayed, err := create(client, ctx, withID(100, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"))
	if err != nil || replayed {
		t.Fatalf("first call: %v, replayed %v", err, replayed)
	}
	again, replayed, err := create(client, ctx, withID(100, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"))
	if err != nil || !replayed || !proto.Equal(first, again) {
		t.Fatalf("retry with the same request_id: %v, replayed %v, %v want %v", err, replayed, again, first)
	}
	// The same key in the metadata, request_id unset: the same request.
	viaMetadata, replayed, err := create(plain, metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"), request(100))
	if err != nil || !replayed || !proto.Equal(first, viaMetadata) {
		t.Fatalf("the key as metadata: %v, replayed %v, %v want %v", err, replayed, viaMetadata, first)
	}
	// Both, agreeing: the same request too.
	both, replayed, err := create(plain, metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"), withID(100, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"))
	if err != nil || !replayed || !proto.Equal(first, both) {
		t.Fatalf("both, agreeing: %v, replayed %v", err, replayed)
	}
	_, _, err = create(client, ctx, withID(200, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)
	wantRuns(t, svc, 1)

	// Both, differing: refused before anything runs, and the message names
	// the field, never a key.
	_, _, err = create(plain, metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "other-key"), withID(300, "8c0a4f9e-3b0e-4a8c-9a51-1f0c2b7d6e11"))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyInvalid)
	if msg := err.Error(); !strings.Contains(msg, "request_id and the idempotency key sent beside it differ") || strings.Contains(msg, "other-key") {
		t.Fatalf("message %q: want it to name request_id, never the key", msg)
	}
	_, _, err = create(plain, ctx, withID(300, "has a space"))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyInvalid)
	// Neither: no key, which WithKeyRequired refuses.
	_, _, err = create(plain, ctx, request(300))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyMissing)
	wantRuns(t, svc, 1)
}
