package interceptor_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
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

// arrivals counts the calls of each method that reach a server.
type arrivals struct {
	mu sync.Mutex
	n  map[string]int
}

func (a *arrivals) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	a.mu.Lock()
	a.n[info.FullMethod]++
	a.mu.Unlock()
	return handler(ctx, req)
}

func (a *arrivals) of(method string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n[method]
}

// lookupClient is a PaymentService client with WithLookupFirst(minBytes)
// on a server with the interceptor and, if keys, the KeyService.
func lookupClient(t *testing.T, svc *service, keys bool, minBytes int) (paymentsv1.PaymentServiceClient, *arrivals) {
	t.Helper()
	eng := grpctest.Must(engine.New(memory.New(), engine.WithTenant(tenantFromMetadata)))
	seen := &arrivals{n: map[string]int{}}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(seen.intercept, grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	if keys {
		if err := interceptor.RegisterKeyService(srv, eng); err != nil {
			t.Fatal(err)
		}
	}
	client := grpctest.Must(interceptor.UnaryClientInterceptor(interceptor.WithLookupFirst(minBytes)))
	conn := grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithUnaryInterceptor(client))
	return paymentsv1.NewPaymentServiceClient(conn), seen
}

func keyed(key string) context.Context {
	return idemkey.ContextWithKey(metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme"), key)
}

// A retry of a large request with the caller's key asks GetKey first, and a
// completed key's reply or error comes from its record without the
// request going out; a new key, a small request, or a server without the
// KeyService sends the request.
func TestLookupFirst(t *testing.T) {
	svc := newService()
	payments, seen := lookupClient(t, svc, true, 1)
	first, err := payments.CreateCharge(keyed("key-1"), request(100))
	if err != nil {
		t.Fatal(err)
	}
	var expires time.Time
	second, err := payments.CreateCharge(keyed("key-1"), request(100), interceptor.KeyExpiry(&expires))
	if err != nil || !proto.Equal(first, second) || expires.IsZero() {
		t.Errorf("a retry with lookup first = %v, %v, expires %v; want the first reply %v and its expiry", second, err, expires, first)
	}
	if n := seen.of(createCharge); n != 1 {
		t.Errorf("CreateCharge reached the server %d times; want once: the retry was answered from GetKey", n)
	}
	if n := seen.of("/idemkey.v1.KeyService/GetKey"); n != 2 {
		t.Errorf("GetKey reached the server %d times; want before each call", n)
	}
	wantRuns(t, svc, 1)

	// The same key with another request is never answered with the first
	// one's reply: GetKey says reused, and the server refuses the request.
	if other, err := payments.CreateCharge(keyed("key-1"), request(200)); status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
		t.Errorf("the key reused with another request, with lookup first = %v, %v; want InvalidArgument %s", other, err, idemkey.ReasonKeyReused)
	}
	if n := seen.of(createCharge); n != 2 {
		t.Errorf("CreateCharge reached the server %d times; want 2: the reused key's request goes, to be refused there", n)
	}
	wantRuns(t, svc, 1)

	svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	}
	_, err = payments.CreateCharge(keyed("key-2"), request(100))
	_, again := payments.CreateCharge(keyed("key-2"), request(100))
	if status.Code(err) != codes.FailedPrecondition || status.Code(again) != codes.FailedPrecondition || status.Convert(again).Message() != "card declined" {
		t.Errorf("a recorded error, then its retry with lookup first = %v, %v; want FailedPrecondition twice", err, again)
	}
	if n := seen.of(createCharge); n != 3 {
		t.Errorf("CreateCharge reached the server %d times; want 3", n)
	}

	getKeys := seen.of("/idemkey.v1.KeyService/GetKey")
	if _, err := payments.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme"), request(100)); status.Code(err) != codes.FailedPrecondition {
		t.Fatal(err)
	}
	if n := seen.of("/idemkey.v1.KeyService/GetKey"); n != getKeys {
		t.Errorf("a call with a new key asked GetKey first; a new key has nothing to ask")
	}

	small, seenSmall := lookupClient(t, newService(), true, 1<<20)
	for range 2 {
		if _, err := small.CreateCharge(keyed("key-1"), request(100)); err != nil {
			t.Fatal(err)
		}
	}
	if n := seenSmall.of("/idemkey.v1.KeyService/GetKey"); n != 0 {
		t.Errorf("requests smaller than WithLookupFirst's asked GetKey %d times; want none", n)
	}

	without, seenWithout := lookupClient(t, newService(), false, 1)
	for range 2 {
		if _, err := without.CreateCharge(keyed("key-1"), request(100)); err != nil {
			t.Fatalf("a call to a server without the KeyService: %v", err)
		}
	}
	if n := seenWithout.of(createCharge); n != 2 {
		t.Errorf("without the KeyService, CreateCharge reached the server %d times; want 2 (the retry replayed there)", n)
	}

	eng := grpctest.Must(engine.New(memory.New(), engine.WithSingleTenant()))
	if _, err := interceptor.UnaryServerInterceptor(eng, interceptor.WithLookupFirst(1)); err == nil {
		t.Error("UnaryServerInterceptor(WithLookupFirst) = nil error; want a refusal: it is a client option")
	}
}
