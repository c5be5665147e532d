package idemconnecttest_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemconnect/idemconnecttest"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/tbtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

const createCharge = "/example.payments.v1.PaymentService/CreateCharge"

// chargeClient serves CreateCharge behind idemconnect's server interceptor
// on a memory store, each charge counted in charges, and returns a client
// with the key interceptor, then the kit's.
func chargeClient(t *testing.T, kit *idemtest.Kit, charges *atomic.Int64) *connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge] {
	t.Helper()
	eng := grpctest.Must(engine.New(memory.New(), engine.WithSingleTenant(), engine.WithLogger(nil)))
	idem := grpctest.Must(idemconnect.NewServerInterceptor(eng))
	mux := http.NewServeMux()
	mux.Handle(createCharge, connect.NewUnaryHandler(createCharge,
		func(_ context.Context, req *connect.Request[paymentsv1.CreateChargeRequest]) (*connect.Response[paymentsv1.Charge], error) {
			if req.Msg.GetCustomerId() == "cus_declined" {
				return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("card declined"))
			}
			charges.Add(1)
			return connect.NewResponse(&paymentsv1.Charge{Id: "ch_" + idemkey.NewKey(), Amount: req.Msg.GetAmount()}), nil
		}, connect.WithInterceptors(idem)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](srv.Client(), srv.URL+createCharge,
		connect.WithInterceptors(idemconnect.NewClientInterceptor(), idemconnecttest.Interceptor(kit)))
}

// charge is a client that retries a call that got no answer, with the key
// it made once for the operation, or with a new key per attempt.
func charge(ctx context.Context, client *connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge], customer string, keyPerAttempt bool) error {
	ctx = idemkey.ContextWithKey(ctx, idemkey.NewKey())
	var err error
	for range 3 {
		if keyPerAttempt {
			ctx = idemkey.ContextWithKey(ctx, idemkey.NewKey())
		}
		_, err = client.CallUnary(ctx, connect.NewRequest(&paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 100, Currency: "EUR"}))
		if connect.CodeOf(err) != connect.CodeUnavailable {
			return err
		}
	}
	return err
}

// The kit passes a correct Connect handler and client under every fault,
// and catches a client that makes a key per attempt.
func TestInterceptor(t *testing.T) {
	var charges atomic.Int64
	effects := func(context.Context) (int, error) { return int(charges.Load()), nil }
	r := tbtest.New(t)
	client := chargeClient(t, idemtest.New(r, idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, LoseReply: true, Effects: effects}), &charges)
	if err := charge(t.Context(), client, "cus_1", false); err != nil {
		t.Errorf("charge: %v", err)
	}
	if err := charge(t.Context(), client, "cus_declined", false); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("declined charge: %v, want failed_precondition", err)
	}
	tbtest.WantPass(t, r)

	r = tbtest.New(t)
	client = chargeClient(t, idemtest.New(r, idemtest.Chaos{LoseReply: true, Effects: effects}), &charges)
	if err := charge(t.Context(), client, "cus_1", true); err != nil {
		t.Errorf("charge: %v", err)
	}
	tbtest.WantFailure(t, r, "a key made per attempt", "idemkey.ContextWithKey", "one key, 2 effects")
}
