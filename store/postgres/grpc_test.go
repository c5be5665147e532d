package postgres_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// roundTrips counts the round trips a pool makes, a statement or a pipelined
// batch each, and the statements it prepares (once per connection and
// statement).
type roundTrips struct{ trips, prepares atomic.Int32 }

func (c *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.trips.Add(1)
	return ctx
}
func (c *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	return ctx
}
func (c *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
func (c *roundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}
func (c *roundTrips) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (c *roundTrips) reset() (trips, prepares int32) {
	return c.trips.Swap(0), c.prepares.Swap(0)
}

type chargeService struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs atomic.Int32
}

func (s *chargeService) CreateCharge(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	s.runs.Add(1)
	return &paymentsv1.Charge{Id: "ch_1"}, nil
}

// serveCharges serves chargeService behind the interceptor on st over
// bufconn until the test ends, and returns a client.
func serveCharges(t *testing.T, st store.Store) (paymentsv1.PaymentServiceClient, *chargeService) {
	t.Helper()
	svc := &chargeService{}
	srv := grpc.NewServer(grpc.UnaryInterceptor(interceptor.UnaryServerInterceptor(st)))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	return paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv))), svc
}

func createCharge(client paymentsv1.PaymentServiceClient, key string) error {
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, key)
	_, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: 1})
	return err
}

// A first call costs the database two statements (reserve, complete), a
// replay one, over a real gRPC server with the interceptor on this store.
func TestRoundTripsPerCall(t *testing.T) {
	tracer := &roundTrips{}
	r := newReplica(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = tracer
		c.MaxConns = 1 // one connection, so statements are prepared once
	})
	client, svc := serveCharges(t, r.store)
	call := func(key string) {
		t.Helper()
		if err := createCharge(client, key); err != nil {
			t.Fatal(err)
		}
	}
	call("warm-up") // connects and prepares both statements
	call("warm-up")
	tracer.reset()

	call("k")
	if q, p := tracer.reset(); q != 2 || p != 0 {
		t.Errorf("first call: %d statements, %d prepares; want 2 (reserve, complete), 0", q, p)
	}
	call("k")
	if q, p := tracer.reset(); q != 1 || p != 0 {
		t.Errorf("replay: %d statements, %d prepares; want 1 (reserve), 0", q, p)
	}
	if n := svc.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times for two keys, want 2", n)
	}
}

// With the database unreachable, a call fails closed: Unavailable, and the
// handler does not run.
func TestUnreachableFailsClosed(t *testing.T) {
	client, svc := serveCharges(t, unreachableStore(t))
	err := createCharge(client, "k")
	if status.Code(err) != codes.Unavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
		t.Errorf("call with the database down: %v, want Unavailable %s", err, idemkey.ReasonStoreUnavailable)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times without the store", n)
	}
}
