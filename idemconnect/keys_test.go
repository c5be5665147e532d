package idemconnect_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// KeyService over Connect, beside the procedures whose keys it tells, on
// one engine: unknown, completed with the reply a retry gets, unknown to
// another tenant, and a procedure not covered refused.
func TestKeyServiceHandler(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithTenant(bearerTenant))
	c := &counter{}
	mux := http.NewServeMux()
	mux.Handle(createCharge, connect.NewUnaryHandler(createCharge, c.handle, connect.WithInterceptors(newInterceptor(t, eng))))
	path, keys, err := idemconnect.NewKeyServiceHandler(eng)
	if err != nil {
		t.Fatal(err)
	}
	mux.Handle(path, keys)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	bearer := func(tenant string) connect.ClientOption {
		return connect.WithInterceptors(connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
			return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
				req.Header().Set("Authorization", "Bearer "+tenant)
				return next(ctx, req)
			}
		}))
	}
	getKey := func(tenant, procedure, key string) (*connect.Response[idemkeyv1.GetKeyResponse], error) {
		client := connect.NewClient[idemkeyv1.GetKeyRequest, idemkeyv1.GetKeyResponse](srv.Client(), srv.URL+"/idemkey.v1.KeyService/GetKey", bearer(tenant))
		return client.CallUnary(context.Background(), connect.NewRequest(&idemkeyv1.GetKeyRequest{Operation: procedure, Key: key}))
	}

	resp, err := getKey("acme", createCharge, "key-1")
	if err != nil || resp.Msg.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
		t.Fatalf("GetKey of a new key = %v, %v; want unknown", resp, err)
	}
	charges := connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](srv.Client(), srv.URL+createCharge, bearer("acme"))
	req := connect.NewRequest(&paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"})
	req.Header().Set(idemkey.KeyHeader, "key-1")
	first, err := charges.CallUnary(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	resp, err = getKey("acme", createCharge, "key-1")
	if err != nil || resp.Msg.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || resp.Header().Get(idemkey.ExpiresHeader) == "" ||
		resp.Header().Get(idemkey.ReplayedHeader) != "" {
		t.Fatalf("GetKey of a completed key = %v, %v; want completed, with its expiry, no replay marker", resp, err)
	}
	var got paymentsv1.Charge
	if err := resp.Msg.GetResponse().UnmarshalTo(&got); err != nil || !proto.Equal(&got, first.Msg) {
		t.Errorf("GetKey's response = %v, %v; want the first reply %v", &got, err, first.Msg)
	}
	if c.runs.Load() != 1 {
		t.Errorf("the handler ran %d times, want once", c.runs.Load())
	}
	if resp, err := getKey("globex", createCharge, "key-1"); err != nil || resp.Msg.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
		t.Errorf("GetKey of acme's key by globex = %v, %v; want unknown", resp, err)
	}
	if _, err := getKey("acme", getCharge, "key-1"); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("GetKey of a procedure not covered = %v; want InvalidArgument", err)
	}
	if _, err := getKey("acme", createCharge, "bad key"); idemkey.Reason(err) != idemkey.ReasonKeyInvalid {
		t.Errorf("GetKey of a malformed key = %v; want %s", err, idemkey.ReasonKeyInvalid)
	}
	if _, _, err := idemconnect.NewKeyServiceHandler(nil); err == nil {
		t.Error("NewKeyServiceHandler(nil) = nil error; want one")
	}
}

// GetKey over Connect on region a tells a key first sent to region b, and
// not yet copied, in progress, as its call is answered; the header
// malformed is refused as a call's is.
func TestKeyServiceFirstRegion(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithTenant(bearerTenant), engine.WithRegion("a"))
	path, keys, err := idemconnect.NewKeyServiceHandler(eng)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(path, keys)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	client := connect.NewClient[idemkeyv1.GetKeyRequest, idemkeyv1.GetKeyResponse](srv.Client(), srv.URL+"/idemkey.v1.KeyService/GetKey")
	getKey := func(region string) (*connect.Response[idemkeyv1.GetKeyResponse], error) {
		req := connect.NewRequest(&idemkeyv1.GetKeyRequest{Operation: createCharge, Key: "key-1"})
		req.Header().Set("Authorization", "Bearer acme")
		req.Header().Set(idemkey.FirstRegionHeader, region)
		return client.CallUnary(context.Background(), req)
	}
	if resp, err := getKey("b"); err != nil || resp.Msg.GetState() != idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS {
		t.Errorf("GetKey of a key first sent to b, on a = %v, %v; want in progress", resp, err)
	}
	if resp, err := getKey("a"); err != nil || resp.Msg.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
		t.Errorf("GetKey of a key first sent to a, on a = %v, %v; want unknown", resp, err)
	}
	if _, err := getKey("B"); idemkey.Reason(err) != idemkey.ReasonFirstSentInvalid {
		t.Errorf("GetKey with a malformed first region = %v; want %s", err, idemkey.ReasonFirstSentInvalid)
	}
}
