package interceptor_test

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// charges is the example's service: every run of CreateCharge is counted.
type charges struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs atomic.Int32
}

func (c *charges) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	c.runs.Add(1)
	return &paymentsv1.Charge{Id: "ch_1", Amount: req.GetAmount(), Currency: req.GetCurrency()}, nil
}

// A server that records the first reply of every key, and a client whose
// retry with the same key gets that reply back without the handler running.
func Example() {
	svc := &charges{}
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		panic(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idem))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := bufconn.Listen(1 << 20)
	go srv.Serve(lis)
	defer srv.Stop()

	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		panic(err)
	}
	conn, _ := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(keys))
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	key := idemkey.NewKey() // one key per business operation, kept for its retries
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 1999, Currency: "EUR"}
	for range 2 {
		var trailer metadata.MD
		charge, err := client.CreateCharge(context.Background(), req, interceptor.UseKey(key), grpc.Trailer(&trailer))
		fmt.Println(charge.GetAmount(), err, "replayed:", idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
	}
	fmt.Println("handler runs:", svc.runs.Load())
	// Output:
	// 1999 <nil> replayed: false
	// 1999 <nil> replayed: true
	// handler runs: 1
}
