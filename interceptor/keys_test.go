package interceptor_test

import (
	"context"
	"testing"
	"time"

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
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// keysE2E is a PaymentService behind the interceptor, with the KeyService
// registered beside it on the same engine and options, over bufconn.
type keysE2E struct {
	svc      *service
	payments paymentsv1.PaymentServiceClient
	keys     keysClient
}

// keysClient calls idemkey.v1.KeyService (idemkey.v1 has no generated
// client: rpckit.GetKeyProcedure).
type keysClient struct{ conn *grpc.ClientConn }

func (c keysClient) GetKey(ctx context.Context, req *idemkeyv1.GetKeyRequest, opts ...grpc.CallOption) (*idemkeyv1.GetKeyResponse, error) {
	resp := new(idemkeyv1.GetKeyResponse)
	if err := c.conn.Invoke(ctx, "/idemkey.v1.KeyService/GetKey", req, resp, opts...); err != nil {
		return nil, err
	}
	return resp, nil
}

func newKeysE2E(t *testing.T, st store.Store, opts ...interceptor.Option) *keysE2E {
	t.Helper()
	eng := grpctest.Must(engine.New(st, engine.WithTenant(tenantFromMetadata), engine.WithRetention(time.Hour)))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng, opts...))))
	e := &keysE2E{svc: newService()}
	paymentsv1.RegisterPaymentServiceServer(srv, e.svc)
	if err := interceptor.RegisterKeyService(srv, eng, opts...); err != nil {
		t.Fatal(err)
	}
	conn := grpctest.Dial(t, grpctest.Serve(t, srv))
	e.payments, e.keys = paymentsv1.NewPaymentServiceClient(conn), keysClient{conn}
	return e
}

func asTenant(tenant string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "tenant", tenant)
}

func (e *keysE2E) getKey(t *testing.T, ctx context.Context, key string, opts ...grpc.CallOption) *idemkeyv1.GetKeyResponse {
	t.Helper()
	resp, err := e.keys.GetKey(ctx, &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: key}, opts...)
	if err != nil {
		t.Fatalf("GetKey: %v", err)
	}
	return resp
}

// A key's state over gRPC in each of its states, as its tenant asks; the
// completed one's reply is the one a retry gets, and another tenant is
// told nothing of the key.
func TestKeyServiceStates(t *testing.T) {
	e := newKeysE2E(t, memory.New())
	acme := asTenant("acme")
	if resp := e.getKey(t, acme, "key-1"); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN || resp.GetExpireTime() != nil {
		t.Errorf("GetKey of a new key = %v; want unknown, no expiry", resp)
	}

	started, release := e.svc.block()
	done := make(chan error, 1)
	var first *paymentsv1.Charge
	go func() {
		var err error
		first, err = e.payments.CreateCharge(withKey(context.Background(), "key-1"), request(100))
		done <- err
	}()
	<-started
	var trailer metadata.MD
	resp := e.getKey(t, acme, "key-1", grpc.Trailer(&trailer))
	if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS || resp.GetRetryAfter().AsDuration() <= 0 || resp.GetExpireTime() == nil {
		t.Errorf("GetKey of a running key = %v; want in progress, a wait, an expiry", resp)
	}
	if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || len(trailer.Get(idemkey.ExpiresMetadata)) != 1 {
		t.Errorf("GetKey's trailer = %v; want the expiry, no replay marker", trailer)
	}
	expires := resp.GetExpireTime().AsTime()
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	resp = e.getKey(t, acme, "key-1")
	if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || resp.GetStatus().GetCode() != 0 || !resp.GetExpireTime().AsTime().Equal(expires) {
		t.Fatalf("GetKey of a completed key = %v; want completed, code 0, expiry %v", resp, expires)
	}
	var got paymentsv1.Charge
	if err := resp.GetResponse().UnmarshalTo(&got); err != nil || !proto.Equal(&got, first) {
		t.Errorf("GetKey's response = %v, %v; want the first reply %v", &got, err, first)
	}
	retry, err := e.payments.CreateCharge(withKey(context.Background(), "key-1"), request(100))
	if err != nil || !proto.Equal(retry, &got) {
		t.Errorf("a retry = %v, %v; want what GetKey told, %v", retry, err, &got)
	}
	wantRuns(t, e.svc, 1)

	if resp := e.getKey(t, asTenant("globex"), "key-1"); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN || resp.GetResponse() != nil {
		t.Errorf("GetKey of acme's key by another tenant = %v; want unknown, nothing else", resp)
	}
	stale := metadata.AppendToOutgoingContext(acme, idemkey.FirstSentMetadata, idemkey.FormatDate(time.Now().Add(-2*time.Hour)))
	if resp := e.getKey(t, stale, "key-2"); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_EXPIRED {
		t.Errorf("GetKey of a key first sent two hours ago = %v; want expired", resp)
	}
	if resp := e.getKey(t, stale, "key-1"); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED {
		t.Errorf("GetKey of a recorded key first sent two hours ago = %v; want completed: the record wins", resp)
	}
	_, err = e.payments.CreateCharge(metadata.AppendToOutgoingContext(withKey(context.Background(), "key-2"),
		idemkey.FirstSentMetadata, idemkey.FormatDate(time.Now().Add(-2*time.Hour))), request(100))
	wantReason(t, err, codes.FailedPrecondition, idemkey.ReasonKeyExpired) // as GetKey told
}

// A recorded error is told as its status, whole, as a retry gets it.
func TestKeyServiceRecordedError(t *testing.T) {
	e := newKeysE2E(t, memory.New())
	e.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return nil, status.Error(codes.FailedPrecondition, "card declined")
	}
	_, err := e.payments.CreateCharge(withKey(context.Background(), "key-1"), request(100))
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("CreateCharge = %v; want FailedPrecondition", err)
	}
	resp := e.getKey(t, asTenant("acme"), "key-1")
	if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || resp.GetStatus().GetCode() != int32(codes.FailedPrecondition) ||
		string(resp.GetStatus().GetMessage()) != "card declined" || resp.GetResponse() != nil {
		t.Errorf("GetKey of a recorded error = %v; want completed, FailedPrecondition \"card declined\", no response", resp)
	}
}

// GetKey's refusals: an operation the interceptor does not cover, a bad key
// or first-sent time, no tenant, a store that cannot look keys up.
func TestKeyServiceRefusals(t *testing.T) {
	e := newKeysE2E(t, memory.New(), interceptor.WithExcludedMethods(createCharge))
	acme := asTenant("acme")
	for name, op := range map[string]string{"excluded": createCharge, "free of side effects": getCharge, "unknown": "/x.v1.Nope/Nope", "empty": ""} {
		_, err := e.keys.GetKey(acme, &idemkeyv1.GetKeyRequest{Operation: op, Key: "key-1"})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("GetKey of an operation %s = %v; want InvalidArgument", name, err)
		}
	}

	e = newKeysE2E(t, memory.New())
	_, err := e.keys.GetKey(acme, &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "bad key"})
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyInvalid)
	_, err = e.keys.GetKey(metadata.AppendToOutgoingContext(acme, idemkey.FirstSentMetadata, "yesterday"),
		&idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"})
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonFirstSentInvalid)
	_, err = e.keys.GetKey(metadata.AppendToOutgoingContext(acme, idemkey.FirstSentMetadata, idemkey.FormatDate(time.Now().Add(time.Hour))),
		&idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"})
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonFirstSentInvalid)
	if _, err := e.keys.GetKey(context.Background(), &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("GetKey without a tenant = %v; want the tenant function's Unauthenticated", err)
	}

	plain := newKeysE2E(t, failingStore{})
	if _, err := plain.keys.GetKey(acme, &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"}); status.Code(err) != codes.Unimplemented {
		t.Errorf("GetKey on a store without Looker = %v; want Unimplemented", err)
	}
	down := newKeysE2E(t, lookupDown{memory.New()})
	_, err = down.keys.GetKey(acme, &idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"})
	wantReason(t, err, codes.Unavailable, idemkey.ReasonStoreUnavailable)
	if err := interceptor.RegisterKeyService(grpc.NewServer(), nil); err == nil {
		t.Error("RegisterKeyService(nil engine) = nil; want an error")
	}
}

// lookupDown is a memory store whose Lookup fails, as a store that is down.
type lookupDown struct{ *memory.Store }

func (lookupDown) Lookup(context.Context, store.Key) (store.Entry, []string, bool, error) {
	return store.Entry{}, nil, false, errDown
}
