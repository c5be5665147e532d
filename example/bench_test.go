package example_test

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// BenchmarkCreateCharge measures a first CreateCharge over bufconn on
// PostgreSQL four ways, interleaved in rotating order so that noise (a slow
// WAL flush) hits all alike, and reports each one's time and its ratio to
// bare:
//   - bare: the service with no idempotency at all; its business transaction
//     is one INSERT, committed on its own (one round trip, one commit);
//   - bare-tx: the same INSERT in an explicit transaction, as a business
//     transaction of more than one statement needs (BEGIN, INSERT, COMMIT:
//     three round trips, one commit);
//   - atomic: the reservation, the INSERT and the record commit together
//     (three round trips, one commit);
//   - two-phase: reserve, INSERT and record each commit on their own (three
//     round trips, three commits).
func BenchmarkCreateCharge(b *testing.B) {
	schema := pgtest.Schema(b)
	pool := migratedPool(b, schema)
	ledger := example.NewPostgresLedger(pool)
	serve := func(srv *grpc.Server) paymentsv1.PaymentServiceClient {
		return paymentsv1.NewPaymentServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
	}
	bare := func(interceptors ...grpc.UnaryServerInterceptor) paymentsv1.PaymentServiceClient {
		srv := grpc.NewServer(grpc.ChainUnaryInterceptor(append([]grpc.UnaryServerInterceptor{example.Authenticate}, interceptors...)...))
		paymentsv1.RegisterPaymentServiceServer(srv, example.NewService(ledger, 0))
		return serve(srv)
	}
	clients := []paymentsv1.PaymentServiceClient{bare(), bare(ledger.InTransaction())} // then atomic, two-phase
	for _, atomic := range []bool{true, false} {
		be := postgresBackend(b, pool, atomic)
		srv, _, _ := example.NewServer(grpctest.Must(example.NewEngine(be.store)), example.Config{Ledger: be.ledger, Atomic: atomic})
		clients = append(clients, serve(srv))
	}
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	var ops []benchtest.Op
	for i, name := range []string{"bare", "bare-tx", "atomic", "two-phase"} {
		call := func(int) error {
			ctx := metadata.AppendToOutgoingContext(as("acme"), idemkey.KeyMetadata, idemkey.NewKey())
			_, err := clients[i].CreateCharge(ctx, req)
			return err
		}
		if err := call(0); err != nil { // connect, and prepare the statements
			b.Fatal(err)
		}
		ops = append(ops, benchtest.Op{Name: name, Run: call})
	}
	ns := benchtest.Interleave(b, ops...)
	for i := 1; i < len(ops); i++ {
		b.ReportMetric(ns[i]/ns[0], ops[i].Name+"/bare")
	}
	b.ReportMetric(ns[2]/ns[1], "atomic/bare-tx")
}
