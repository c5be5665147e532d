package idemgateway_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemgateway"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// payments is the example's gRPC service: every run of CreateCharge is
// counted.
type payments struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs atomic.Int32
}

func (p *payments) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	n := p.runs.Add(1)
	return &paymentsv1.Charge{Id: fmt.Sprintf("ch_%d", n), CustomerId: req.GetCustomerId(), Amount: req.GetAmount()}, nil
}

// A grpc-gateway in front of a gRPC service behind idemkey's interceptor:
// with ServeMuxOptions the gateway forwards the Idempotency-Key header to
// the call and sends the replay marker back as the Idempotent-Replayed
// header, so that an HTTP client's retry gets the first reply, marked, and
// the service runs once.
func ExampleServeMuxOptions() {
	// The gRPC service, behind idemkey's interceptor (on a listener in
	// memory here; yours listens on a port).
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		panic(err)
	}
	svc := &payments{}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idem))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := bufconn.Listen(1 << 20)
	go srv.Serve(lis)
	defer srv.Stop()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	defer conn.Close()

	// The gateway: a ServeMux with idemkey's options.
	mux := runtime.NewServeMux(idemgateway.ServeMuxOptions()...)
	// Generated code registers the routes of the service's HTTP annotations:
	// paymentsv1gw.RegisterPaymentServiceHandlerClient(ctx, mux, client).
	registerCreateCharge(mux, paymentsv1.NewPaymentServiceClient(conn))
	gw := httptest.NewServer(mux)
	defer gw.Close()

	for range 2 { // a call, and its retry with the same key
		req, _ := http.NewRequest("POST", gw.URL+"/v1/charges", strings.NewReader(`{"customerId":"cus_1","amount":1999,"currency":"EUR"}`))
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		var charge struct{ ID string }
		json.NewDecoder(resp.Body).Decode(&charge)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, charge.ID, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("runs:", svc.runs.Load())
	// Output:
	// 200 ch_1 replayed: false
	// 200 ch_1 replayed: true
	// runs: 1
}

// registerCreateCharge routes POST /v1/charges to client's CreateCharge as
// protoc-gen-grpc-gateway's code does for a rule with body "*".
func registerCreateCharge(mux *runtime.ServeMux, client paymentsv1.PaymentServiceClient) {
	const method = "/example.payments.v1.PaymentService/CreateCharge"
	err := mux.HandlePath("POST", "/v1/charges", func(w http.ResponseWriter, r *http.Request, _ map[string]string) {
		inbound, outbound := runtime.MarshalerForRequest(mux, r)
		ctx, err := runtime.AnnotateContext(r.Context(), mux, r, method, runtime.WithHTTPPathPattern("/v1/charges"))
		if err != nil {
			runtime.HTTPError(r.Context(), mux, outbound, w, r, err)
			return
		}
		var req paymentsv1.CreateChargeRequest
		if err := inbound.NewDecoder(r.Body).Decode(&req); err != nil {
			runtime.HTTPError(ctx, mux, outbound, w, r, status.Error(codes.InvalidArgument, err.Error()))
			return
		}
		var md runtime.ServerMetadata
		resp, err := client.CreateCharge(ctx, &req, grpc.Header(&md.HeaderMD), grpc.Trailer(&md.TrailerMD))
		ctx = runtime.NewServerMetadataContext(ctx, md)
		if err != nil {
			runtime.HTTPError(ctx, mux, outbound, w, r, err)
			return
		}
		runtime.ForwardResponseMessage(ctx, mux, outbound, w, r, resp, mux.GetForwardResponseOptions()...)
	})
	if err != nil {
		panic(err)
	}
}
