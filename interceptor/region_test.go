package interceptor_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// The client sends the first region a caller gives with its key, on every
// attempt, and only with that key; a malformed one fails before it is sent.
func TestClientFirstRegion(t *testing.T) {
	svc, client, _ := newSeenE2E(t)
	at := time.Now().Add(-time.Minute)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	for _, tc := range []struct {
		name string
		ctx  context.Context
		opts []grpc.CallOption
		want string // "": none
	}{
		{"UseKeyFirstRegion", ctx, []grpc.CallOption{interceptor.UseKeyFirstRegion("order-1", at, "eu-west-1")}, "eu-west-1"},
		{"ContextWithKeyFirstRegion", idemkey.ContextWithKeyFirstRegion(ctx, "order-2", at, "eu-west-1"), nil, "eu-west-1"},
		{"no region", ctx, []grpc.CallOption{interceptor.UseKeyFirstRegion("order-3", at, "")}, ""},
		{"UseKey drops the context's region with its key",
			idemkey.ContextWithKeyFirstRegion(ctx, "order-4", at, "eu-west-1"), []grpc.CallOption{interceptor.UseKey("order-5")}, ""},
		{"the metadata's key drops the context's region",
			metadata.AppendToOutgoingContext(idemkey.ContextWithKeyFirstRegion(ctx, "order-6", at, "eu-west-1"), idemkey.KeyMetadata, "order-7"), nil, ""},
		{"the metadata's region is kept",
			metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "order-8", idemkey.FirstSentMetadata, idemkey.FormatDate(at),
				idemkey.FirstRegionMetadata, "us-east-2"), nil, "us-east-2"},
	} {
		if _, err := client.CreateCharge(tc.ctx, request(1), tc.opts...); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		seen := drainMD(svc.seen)
		if len(seen) != 1 {
			t.Fatalf("%s: the server saw %d calls, want 1", tc.name, len(seen))
		}
		if got := seen[0].Get(idemkey.FirstRegionMetadata); strings.Join(got, ",") != tc.want {
			t.Errorf("%s: the server saw first region %q, want %q", tc.name, got, tc.want)
		}
	}
	wantRuns(t, svc.service, 6)

	for _, tc := range []struct {
		name string
		ctx  context.Context
		opts []grpc.CallOption
	}{
		{"UseKeyFirstRegion", ctx, []grpc.CallOption{interceptor.UseKeyFirstRegion("order-9", at, "Secret-Region")}},
		{"ContextWithKeyFirstRegion", idemkey.ContextWithKeyFirstRegion(ctx, "order-9", at, "secret_region"), nil},
		{"the metadata's", metadata.AppendToOutgoingContext(ctx, idemkey.FirstRegionMetadata, "secret region"), nil},
		{"the metadata's, twice", metadata.AppendToOutgoingContext(ctx, idemkey.FirstRegionMetadata, "a", idemkey.FirstRegionMetadata, "a"), nil},
		// A region without the time the key was first sent would be told
		// "now" at every attempt: never stale where its record never comes.
		{"UseKeyFirstRegion without a time", ctx, []grpc.CallOption{interceptor.UseKeyFirstRegion("order-10", time.Time{}, "eu-west-1")}},
		{"ContextWithKeyFirstRegion without a time", idemkey.ContextWithKeyFirstRegion(ctx, "order-10", time.Time{}, "eu-west-1"), nil},
		{"the metadata's without a time", metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "order-10", idemkey.FirstRegionMetadata, "eu-west-1"), nil},
	} {
		_, err := client.CreateCharge(tc.ctx, request(1), tc.opts...)
		wantReason(t, err, codes.InvalidArgument, idemkey.ReasonFirstSentInvalid)
		if strings.Contains(strings.ToLower(err.Error()), "secret") {
			t.Errorf("%s: %v; want the region unquoted", tc.name, err)
		}
	}
	if seen := drainMD(svc.seen); len(seen) != 0 {
		t.Errorf("malformed regions reached the server: %d calls", len(seen))
	}
	wantRuns(t, svc.service, 6)
}

// A client that fails over with a saved key and its first region is held
// off by the other region until the first region's record is there, then
// replayed it: the charge runs once. The two regions' servers share one
// store, as replication that has caught up would.
func TestFirstRegionFailover(t *testing.T) {
	st := memory.New()
	svc := newService()
	dial := func(region string) paymentsv1.PaymentServiceClient {
		srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(st, engine.WithTenant(tenantFromMetadata), engine.WithRegion(region))))
		paymentsv1.RegisterPaymentServiceServer(srv, svc)
		return paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDisableRetry(),
			grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))
	}
	a, b := dial("a"), dial("b")
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	saved := interceptor.UseKeyFirstRegion("order-1", time.Now(), "b")

	_, err := a.CreateCharge(ctx, request(1), saved)
	wantReason(t, err, codes.Aborted, idemkey.ReasonInProgress)
	if d, ok := idemkey.RetryDelay(err); !ok || d <= 0 {
		t.Errorf("the fenced call asked for a retry delay of %v (%v); want one", d, ok)
	}
	wantRuns(t, svc, 0)
	first, err := b.CreateCharge(ctx, request(1), saved)
	if err != nil {
		t.Fatal(err)
	}
	var trailer metadata.MD
	again, err := a.CreateCharge(ctx, request(1), saved, grpc.Trailer(&trailer))
	if err != nil || again.GetId() != first.GetId() || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("region a after b's record: %v, %v; want b's reply %v, replayed", again, err, first)
	}
	wantRuns(t, svc, 1)
}

// GetKey on a region's server tells a key first sent to another region, and
// not yet copied here, as a call of it is answered: in progress (a retry is
// held off), not unknown ("a retry runs"), which a client that failed over
// could read as the operation never having run anywhere. A key first sent
// here, or with no region, stays unknown; a malformed region is refused as
// a call's is.
func TestKeyServiceFirstRegion(t *testing.T) {
	st := memory.New()
	eng := grpctest.Must(engine.New(st, engine.WithTenant(tenantFromMetadata), engine.WithRegion("a")))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	svc := newService()
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	if err := interceptor.RegisterKeyService(srv, eng); err != nil {
		t.Fatal(err)
	}
	keys := keysClient{grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDisableRetry())}
	getKey := func(region ...string) (*idemkeyv1.GetKeyResponse, error) {
		ctx := asTenant("acme")
		for _, r := range region {
			ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstRegionMetadata, r)
		}
		return keys.GetKey(ctx, &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "order-1"})
	}
	resp, err := getKey("b")
	if err != nil || resp.GetState() != idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS || resp.GetRetryAfter().AsDuration() <= 0 {
		t.Errorf("GetKey of a key first sent to b, on a = %v, %v; want in progress with a retry delay, as its call is answered", resp, err)
	}
	for _, region := range [][]string{nil, {"a"}} {
		if resp, err := getKey(region...); err != nil || resp.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
			t.Errorf("GetKey of a new key first sent to %q, on a = %v, %v; want unknown", region, resp, err)
		}
	}
	for _, region := range [][]string{{"Secret-B"}, {"b", "b"}} {
		_, err := getKey(region...)
		wantReason(t, err, codes.InvalidArgument, idemkey.ReasonFirstSentInvalid)
		if err != nil && strings.Contains(strings.ToLower(err.Error()), "secret") {
			t.Errorf("%v; want the region unquoted", err)
		}
	}
	wantRuns(t, svc, 0)
}

// A fenced call under gRPC's retry policy (Aborted retried, as the
// example's service config does) is retried within the policy's attempts,
// each told the retry delay as pushback, and then fails Aborted: never
// retried for ever, never run here.
func TestFenceRetryPolicy(t *testing.T) {
	var attempts atomic.Int64
	count := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		attempts.Add(1)
		return next(ctx, req)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(count,
		grpctest.Interceptor(memory.New(), engine.WithTenant(tenantFromMetadata), engine.WithRegion("a"), engine.WithMaxRetryAfter(5*time.Millisecond))))
	svc := newService()
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv),
		grpc.WithDefaultServiceConfig(retryServiceConfig), grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	_, err := client.CreateCharge(ctx, request(1), interceptor.UseKeyFirstRegion("order-1", time.Now(), "b"))
	wantReason(t, err, codes.Aborted, idemkey.ReasonInProgress)
	if n := attempts.Load(); n != 5 {
		t.Errorf("the fenced call reached the server %d times; want the policy's 5 attempts", n)
	}
	wantRuns(t, svc, 0)
}
