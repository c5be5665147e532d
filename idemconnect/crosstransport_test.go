package idemconnect_test

import (
	"context"
	"errors"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// grpcCharges serves a counter's CreateCharge over grpc-go.
type grpcCharges struct {
	paymentsv1.UnimplementedPaymentServiceServer
	c *counter
}

func (g grpcCharges) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	resp, err := g.c.handle(ctx, connect.NewRequest(req))
	var ce *connect.Error
	if errors.As(err, &ce) {
		st, _ := status.New(codes.Code(ce.Code()), ce.Message()).WithDetails(declined)
		return nil, st.Err()
	}
	return resp.Msg, err
}

func acme(context.Context) (string, error) { return "acme", nil }

// A key first used over gRPC replays over Connect, and the reverse: one
// store, one tenant, one operation name, one fingerprint, one record format.
func TestCrossTransport(t *testing.T) {
	st := memory.New()
	runs := &counter{}
	eng := newEngine(t, st, engine.WithTenant(acme)) // one engine for both entry points
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, grpcCharges{c: runs})
	grpcClient := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	url := serve(t, runs.handle, newInterceptor(t, eng))
	connectClient := newChargeClient(t, url)
	jsonClient := newChargeClient(t, url, connect.WithProtoJSON())
	ctx := t.Context()
	withKey := func(key string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
	}
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

	t.Run("gRPC then Connect", func(t *testing.T) {
		first, err := grpcClient.CreateCharge(withKey("k1"), req)
		if err != nil {
			t.Fatal(err)
		}
		for _, client := range []*connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge]{connectClient, jsonClient} {
			replay, err := call(ctx, client, "k1", req)
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(first, replay.Msg) || !idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)) {
				t.Fatalf("Connect got %v (replayed %v), want the gRPC reply %v marked replayed", replay.Msg, idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)), first)
			}
		}
		runs.wantRuns(t, 1)
	})
	t.Run("Connect then gRPC", func(t *testing.T) {
		first, err := call(ctx, jsonClient, "k2", req)
		if err != nil {
			t.Fatal(err)
		}
		var trailer metadata.MD
		replay, err := grpcClient.CreateCharge(withKey("k2"), req, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(first.Msg, replay) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Fatalf("gRPC got %v (trailer %v), want the Connect reply %v marked replayed", replay, trailer, first.Msg)
		}
		runs.wantRuns(t, 2)
	})
	decline := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Description: "decline"}
	t.Run("a recorded error, gRPC then Connect", func(t *testing.T) {
		_, first := grpcClient.CreateCharge(withKey("k3"), decline)
		_, replay := call(ctx, connectClient, "k3", decline)
		wantSameError(t, status.Convert(first), replay)
		if ce := (*connect.Error)(nil); !errors.As(replay, &ce) || !idemkey.ParseReplayed(ce.Meta().Values(idemkey.ReplayedHeader)) {
			t.Errorf("Connect replay %v is not marked replayed", replay)
		}
		runs.wantRuns(t, 3)
	})
	t.Run("a recorded error, Connect then gRPC", func(t *testing.T) {
		_, first := call(ctx, connectClient, "k4", decline)
		var trailer metadata.MD
		_, replay := grpcClient.CreateCharge(withKey("k4"), decline, grpc.Trailer(&trailer))
		wantSameError(t, status.Convert(replay), first)
		if !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Errorf("gRPC replay's trailer %v is not marked replayed", trailer)
		}
		runs.wantRuns(t, 4)
	})
	t.Run("reused across transports", func(t *testing.T) {
		other := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 200, Currency: "EUR"}
		_, err := call(ctx, connectClient, "k1", other)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
			t.Errorf("Connect, key of a gRPC call, another request: %v, want reused", err)
		}
		_, err = grpcClient.CreateCharge(withKey("k2"), other)
		if status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
			t.Errorf("gRPC, key of a Connect call, another request: %v, want reused", err)
		}
		runs.wantRuns(t, 4)
	})
}

// wantSameError checks that a gRPC status and a Connect error carry one
// error: code, message and details.
func wantSameError(t *testing.T, st *status.Status, err error) {
	t.Helper()
	var ce *connect.Error
	if !errors.As(err, &ce) {
		t.Fatalf("Connect error %v is not a *connect.Error", err)
	}
	if int(st.Code()) != int(ce.Code()) || st.Message() != ce.Message() || st.Code() != codes.FailedPrecondition {
		t.Fatalf("gRPC %v, Connect %v: want one FailedPrecondition", st, ce)
	}
	if len(st.Details()) != 1 || len(ce.Details()) != 1 {
		t.Fatalf("details: gRPC %v, Connect %d; want one each", st.Details(), len(ce.Details()))
	}
	cd, derr := ce.Details()[0].Value()
	if derr != nil || !proto.Equal(cd, declined) || !proto.Equal(st.Details()[0].(*errdetails.ErrorInfo), declined) {
		t.Fatalf("details: gRPC %v, Connect %v (%v); want %v", st.Details()[0], cd, derr, declined)
	}
}
