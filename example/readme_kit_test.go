package example_test

// This file is the README's "Test your handlers" snippet, between the
// markers; the README's copy must match it (TestREADMESnippets).

import (
	"context"
	"net"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// readme:kit
// TestCreateChargeRetries proves the service safe to retry: each call's
// first reply is dropped, three duplicates go at once and the first attempt
// is cancelled in its handler; every attempt must get one answer, and the
// call must charge once. A failure names the mistake and lists the attempts.
func TestCreateChargeRetries(t *testing.T) {
	svc := &countedPayments{}
	kit := idemtest.New(t, idemtest.Chaos{
		DropReply:  true,        // the first reply is lost: the retry with its key must get it, replayed
		Duplicates: 3,           // three more attempts at once, with the same key
		Cancel:     true,        // the first attempt is cancelled in its handler, then sent again
		Effects:    svc.charges, // yours: a SELECT count(*), a fake provider's calls
	})
	addr := startServer(t, svc) // your server, behind idemkey's interceptor
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(keys, kit.UnaryClientInterceptor())) // the kit after the keys
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer acme")
	if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 1999, Currency: "EUR"}); err != nil {
		t.Fatal(err)
	}
}

// end readme

// countedPayments is the README's payments service, its charges counted.
type countedPayments struct {
	payments
	n atomic.Int64
}

func (p *countedPayments) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	p.n.Add(1)
	return p.payments.CreateCharge(ctx, req)
}

func (p *countedPayments) charges(context.Context) (int, error) { return int(p.n.Load()), nil }

// startServer serves svc as the README's newServer serves its payments, on
// a loopback port, until t ends.
func startServer(t *testing.T, svc paymentsv1.PaymentServiceServer) string {
	t.Helper()
	eng, err := engine.New(memory.New(), engine.WithTenant(callerTenant), engine.WithKeyRequired())
	if err != nil {
		t.Fatal(err)
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}
