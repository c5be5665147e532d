package example_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemconnect/idemconnecttest"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// kitDelay holds CreateCharge after its insert, so that the kit's Cancel
// finds a first attempt in its handler.
const kitDelay = 200 * time.Millisecond

// kitCustomer is the customer of the kit's charges.
const kitCustomer = "cus_kit"

// kitTransports are the example's entry points, each as a function that
// serves the example on b and returns a CreateCharge through the kit's
// adapter for that transport. charge sends req under key, retrying (with
// that key) a call that got no answer, and returns the answer's gRPC code.
var kitTransports = []struct {
	name   string
	client func(t *testing.T, b backend, kit *idemtest.Kit) (charge func(ctx context.Context, key string, req *paymentsv1.CreateChargeRequest) codes.Code)
}{
	{"grpc", kitGRPC},
	{"connect", kitConnect},
	{"http", kitHTTP},
}

// kitServe serves the example on b, with kitDelay: its gRPC server, and its
// HTTP handler (Connect, and the POST /v1/charges gateway to the gRPC
// server).
func kitServe(t *testing.T, b backend) (*bufconn.Listener, http.Handler) {
	t.Helper()
	eng := grpctest.Must(example.NewEngine(b.store))
	cfg := example.Config{Ledger: b.ledger, Atomic: b.atomic, HandlerDelay: kitDelay}
	srv, _, err := example.NewServer(eng, cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis := grpctest.Serve(t, srv)
	h, err := example.NewHTTPHandler(eng, cfg, grpctest.Dial(t, lis))
	if err != nil {
		t.Fatal(err)
	}
	return lis, h
}

// retried sends a call until it gets an answer, at most three times: a
// client's retry loop, the key made once for the operation.
func retried(send func() codes.Code) codes.Code {
	var code codes.Code
	for range 3 {
		if code = send(); code != codes.Unavailable {
			break
		}
	}
	return code
}

func kitGRPC(t *testing.T, b backend, kit *idemtest.Kit) func(context.Context, string, *paymentsv1.CreateChargeRequest) codes.Code {
	lis, _ := kitServe(t, b)
	conn := grpctest.Dial(t, lis, grpc.WithDefaultServiceConfig(example.ServiceConfig),
		grpc.WithChainUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()), kit.UnaryClientInterceptor()))
	client := paymentsv1.NewPaymentServiceClient(conn)
	return func(ctx context.Context, key string, req *paymentsv1.CreateChargeRequest) codes.Code {
		return retried(func() codes.Code {
			_, err := client.CreateCharge(idemkey.ContextWithKey(as("acme"), key), req)
			return status.Code(err)
		})
	}
}

func kitConnect(t *testing.T, b backend, kit *idemtest.Kit) func(context.Context, string, *paymentsv1.CreateChargeRequest) codes.Code {
	_, h := kitServe(t, b)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	client := paymentsv1connect.NewPaymentServiceClient(srv.Client(), srv.URL,
		connect.WithInterceptors(idemconnect.NewClientInterceptor(), idemconnecttest.Interceptor(kit)))
	return func(ctx context.Context, key string, req *paymentsv1.CreateChargeRequest) codes.Code {
		return retried(func() codes.Code {
			r := connect.NewRequest(req)
			r.Header().Set("Authorization", "Bearer sk_test_acme")
			_, err := client.CreateCharge(idemkey.ContextWithKey(ctx, key), r)
			if err == nil {
				return codes.OK
			}
			return codes.Code(connect.CodeOf(err))
		})
	}
}

func kitHTTP(t *testing.T, b backend, kit *idemtest.Kit) func(context.Context, string, *paymentsv1.CreateChargeRequest) codes.Code {
	_, h := kitServe(t, b)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: kit.RoundTripper(srv.Client().Transport)}
	return func(ctx context.Context, key string, req *paymentsv1.CreateChargeRequest) codes.Code {
		body, err := protojson.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		return retried(func() codes.Code {
			r, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(string(body)))
			if err != nil {
				t.Fatal(err)
			}
			r.Header.Set("Authorization", "Bearer sk_test_acme")
			r.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(key))
			resp, err := client.Do(r)
			if err != nil {
				return codes.Unavailable
			}
			defer resp.Body.Close()
			io.Copy(io.Discard, resp.Body)
			return httpCode(resp.StatusCode)
		})
	}
}

// httpCode is the gRPC code the example's HTTP route answers with status.
func httpCode(status int) codes.Code {
	switch status {
	case http.StatusCreated:
		return codes.OK
	case http.StatusBadRequest:
		return codes.FailedPrecondition // a declined card, as Connect maps it
	case http.StatusConflict:
		return codes.AlreadyExists
	}
	return codes.Unknown
}

// kitEffects counts the charges of the kit's customers, the effects of
// CreateCharge.
func kitEffects(b backend) func(ctx context.Context) (int, error) {
	return func(ctx context.Context) (int, error) {
		n := 0
		for _, customer := range []string{kitCustomer, example.DeclinedCustomer} {
			charges, _, err := b.ledger.List(ctx, "acme", customer, example.Position{}, 1000)
			if err != nil {
				return 0, err
			}
			n += len(charges)
		}
		return n, nil
	}
}

// The example's CreateCharge and its clients pass the kit under every fault
// on every entry point, store and mode: a charge, a declined card and a
// repeated merchant_reference each take effect once at most, and every
// attempt gets the first one's answer.
func TestKit(t *testing.T) {
	for _, tr := range kitTransports {
		t.Run(tr.name, func(t *testing.T) {
			forEachBackend(t, func(t *testing.T, b backend) {
				kit := idemtest.New(t, idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, LoseReply: true, Effects: kitEffects(b)})
				charge := tr.client(t, b, kit)
				ref := "order-" + idemkey.NewKey()
				for _, tc := range []struct {
					req  *paymentsv1.CreateChargeRequest
					want codes.Code
				}{
					{&paymentsv1.CreateChargeRequest{CustomerId: kitCustomer, Amount: 100, Currency: "EUR", MerchantReference: ref}, codes.OK},
					{&paymentsv1.CreateChargeRequest{CustomerId: example.DeclinedCustomer, Amount: 100, Currency: "EUR"}, codes.FailedPrecondition},
					{&paymentsv1.CreateChargeRequest{CustomerId: kitCustomer, Amount: 200, Currency: "EUR", MerchantReference: ref}, codes.AlreadyExists},
				} {
					if got := charge(t.Context(), idemkey.NewKey(), tc.req); got != tc.want {
						t.Errorf("CreateCharge(%v): %v, want %v", tc.req, got, tc.want)
					}
				}
			})
		})
	}
}

// On PostgreSQL, CreateCharge's insert joins the call's transaction in
// atomic mode: its charge rolls back with it.
func TestKitAtomic(t *testing.T) {
	b := postgresBackend(t, migratedPool(t, pgtest.Schema(t)), true)
	kit := idemtest.New(t, idemtest.Chaos{Effects: kitEffects(b)})
	svc := example.NewService(b.ledger, 0)
	kit.CheckAtomic(b.store, func(ctx context.Context) error {
		_, err := svc.CreateCharge(example.ContextWithTenant(ctx, "acme"),
			&paymentsv1.CreateChargeRequest{CustomerId: kitCustomer, Amount: 100, Currency: "EUR"})
		return err
	})
}
