package idemconnect_test

import (
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// TestKeyField covers AIP-155 over Connect: the key in request_id, in the
// header, or first in a gRPC call's request_id, names one operation.
func TestKeyField(t *testing.T) {
	st := memory.New()
	runs := &counter{}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(newEngine(t, st, engine.WithTenant(acme)),
		interceptor.WithKeyField("request_id")))))
	paymentsv1.RegisterPaymentServiceServer(srv, grpcCharges{c: runs})
	grpcClient := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	url := serve(t, runs.handle, newInterceptor(t, newEngine(t, st, engine.WithTenant(acme), engine.WithKeyRequired()),
		idemconnect.WithKeyField("request_id")))
	// The client, told of the field, adds no key to a request that has one.
	client := newChargeClient(t, url, connect.WithProtoJSON(),
		connect.WithInterceptors(idemconnect.NewClientInterceptor(idemconnect.WithKeyField("request_id"))))
	const id = "5d0b5a3e-7c1f-4b8e-9a0d-2c6e1f3b4a59"
	req := func(amount int64, requestID string) *paymentsv1.CreateChargeRequest {
		return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR", RequestId: requestID}
	}

	first, err := grpcClient.CreateCharge(t.Context(), req(100, id))
	if err != nil {
		t.Fatal(err)
	}
	for name, send := range map[string]func() (*chargeResponse, error){
		"request_id":               func() (*chargeResponse, error) { return call(t.Context(), client, "", req(100, id)) },
		"header":                   func() (*chargeResponse, error) { return call(t.Context(), client, id, req(100, "")) },
		"header and request_id":    func() (*chargeResponse, error) { return call(t.Context(), client, id, req(100, id)) },
		"request_id, plain client": func() (*chargeResponse, error) { return call(t.Context(), newChargeClient(t, url), "", req(100, id)) },
	} {
		resp, err := send()
		if err != nil || !idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)) || !proto.Equal(resp.Msg, first) {
			t.Fatalf("%s: %v, want the gRPC call's reply replayed", name, err)
		}
	}
	_, err = call(t.Context(), client, "another-key", req(100, id))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyInvalid {
		t.Fatalf("header and request_id differing: %v, want %s", err, idemkey.ReasonKeyInvalid)
	}
	_, err = call(t.Context(), client, "", req(200, id))
	if idemkey.Reason(err) != idemkey.ReasonKeyReused {
		t.Fatalf("request_id reused: %v, want %s", err, idemkey.ReasonKeyReused)
	}
	runs.wantRuns(t, 1)

	// And the reverse: first over Connect, with request_id alone, then gRPC
	// with the metadata key.
	const id2 = "0f3e2d1c-4b5a-4697-8877-665544332211"
	resp, err := call(t.Context(), client, "", req(300, id2))
	if err != nil {
		t.Fatal(err)
	}
	var trailer metadata.MD
	again, err := grpcClient.CreateCharge(metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, id2), req(300, ""), grpc.Trailer(&trailer))
	if err != nil || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || !proto.Equal(again, resp.Msg) {
		t.Fatalf("gRPC after Connect: %v, want the replay", err)
	}
	runs.wantRuns(t, 2)
}
