package example_test

// This file is docs/grpc.md's whole server and client, between the markers;
// the page's copy must match it (TestREADMESnippets). The README's first
// snippet (readme_start_test.go) uses its helpers.

// readme:use
import (
	"context"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// Server: record the first reply of each key, replay it to every retry.
// Serve it with srv.Serve(lis).
func newServer() (*grpc.Server, error) {
	eng, err := engine.New(memory.New(), // one per process, for every entry point
		engine.WithTenant(callerTenant), // reads the tenant back
		engine.WithKeyRequired())
	if err != nil {
		return nil, err // a mistake in the options
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		authInterceptor, // your authentication: puts the caller's tenant in the context
		idem,
	))
	paymentsv1.RegisterPaymentServiceServer(srv, payments{})
	return srv, nil
}

type payments struct { // your service
	paymentsv1.UnimplementedPaymentServiceServer
}

func (payments) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	return &paymentsv1.Charge{Id: "ch_" + idemkey.NewKey(), CustomerId: req.GetCustomerId(),
		Amount: req.GetAmount(), Currency: req.GetCurrency()}, nil
}

type callerKey struct{}

// authInterceptor stands in for your authentication: "authorization: Bearer <tenant>".
func authInterceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	auth := md.Get("authorization")
	if len(auth) != 1 || !strings.HasPrefix(auth[0], "Bearer ") {
		return nil, status.Error(codes.Unauthenticated, "unauthenticated")
	}
	return next(context.WithValue(ctx, callerKey{}, strings.TrimPrefix(auth[0], "Bearer ")), req)
}

func callerTenant(ctx context.Context) (string, error) {
	tenant, ok := ctx.Value(callerKey{}).(string)
	if !ok {
		return "", status.Error(codes.Unauthenticated, "no tenant")
	}
	return tenant, nil
}

// Client: one key per operation; gRPC's own retries resend it.
func charge(ctx context.Context, addr string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()), // TLS in production
		grpc.WithDefaultServiceConfig(serviceConfig),             // retries ABORTED and UNAVAILABLE
		grpc.WithUnaryInterceptor(keys))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)

	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer acme")
	key := idemkey.NewKey() // keep it with the order, to retry after a restart
	return client.CreateCharge(ctx, req, interceptor.UseKey(key))
}

// serviceConfig retries CreateCharge on UNAVAILABLE and ABORTED: a duplicate
// of a running call is Aborted with a pushback, and converges on its reply.
const serviceConfig = `{"methodConfig": [{
	"name": [{"service": "example.payments.v1.PaymentService", "method": "CreateCharge"}],
	"timeout": "10s",
	"retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s",
		"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}
}]}`

// end readme
