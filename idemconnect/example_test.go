package idemconnect_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// A Connect handler behind the server interceptor, and a client whose
// interceptor attaches a key: a retry of the same request is answered with
// the first reply, marked replayed, and the handler runs once.
func ExampleNewServerInterceptor() {
	// One engine per store, shared by every entry point that serves its keys.
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	runs := 0
	idem, err := idemconnect.NewServerInterceptor(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	const procedure = "/example.payments.v1.PaymentService/CreateCharge"
	mux.Handle(procedure, connect.NewUnaryHandler(procedure,
		func(_ context.Context, req *connect.Request[paymentsv1.CreateChargeRequest]) (*connect.Response[paymentsv1.Charge], error) {
			runs++
			return connect.NewResponse(&paymentsv1.Charge{Id: fmt.Sprintf("ch_%d", runs), Amount: req.Msg.GetAmount()}), nil
		}, connect.WithInterceptors(idem)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	client := connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](srv.Client(), srv.URL+procedure,
		connect.WithInterceptors(idemconnect.NewClientInterceptor()))
	req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
	for range 2 { // a call, and its retry
		resp, err := client.CallUnary(context.Background(), req)
		if err != nil {
			panic(err)
		}
		fmt.Println(resp.Msg.GetId(), "replayed:", idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)))
	}
	fmt.Println("runs:", runs)
	// Output:
	// ch_1 replayed: false
	// ch_1 replayed: true
	// runs: 1
}
