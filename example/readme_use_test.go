package example_test

// This file is the README's "Use it" snippet, between the markers; the
// README's copy must match it (TestREADMESnippets).

// readme:use
import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// Server: record the first reply of each key, replay it to every retry.
// Serve it with srv.Serve(lis).
func newServer() (*grpc.Server, error) {
	idem, err := interceptor.UnaryServerInterceptor(memory.New(),
		interceptor.WithTenant(example.Tenant), // reads the tenant back
		interceptor.WithKeyRequired())
	if err != nil {
		return nil, err // a mistake in the options
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		example.Authenticate, // your authentication: puts the caller's tenant in the context
		idem,
	))
	payments := example.NewService(example.NewMemoryLedger(), 0) // your service
	paymentsv1.RegisterPaymentServiceServer(srv, payments)
	return srv, nil
}

// Client: one key per operation; gRPC's own retries resend it.
func charge(ctx context.Context, addr string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()), // TLS in production
		grpc.WithDefaultServiceConfig(example.ServiceConfig),     // retries ABORTED and UNAVAILABLE
		grpc.WithUnaryInterceptor(keys))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme")
	key := idemkey.NewKey() // keep it with the order, to retry after a restart
	return client.CreateCharge(ctx, req, interceptor.UseKey(key))
}

// end readme
