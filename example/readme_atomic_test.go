package example_test

// This file is docs/stores.md's "Atomic mode" snippet, between the markers;
// the page's copy must match it (TestREADMESnippets).

// readme:atomic
import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// newAtomicServer runs CreateCharge in atomic mode on st, a PostgreSQL store.
func newAtomicServer(st *postgres.Store) (*grpc.Server, error) {
	eng, err := engine.New(st,
		engine.WithTenant(callerTenant),
		engine.WithKeyRequired()) // a call without a key never reaches the handler
	if err != nil {
		return nil, err
	}
	idem, err := interceptor.UnaryServerInterceptor(eng,
		interceptor.WithAtomicMethods(paymentsv1.PaymentService_CreateCharge_FullMethodName))
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, &ledger{})
	return srv, nil
}

type ledger struct {
	paymentsv1.UnimplementedPaymentServiceServer
}

func (*ledger) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	// tx has pgx's Exec, Query, QueryRow, SendBatch and CopyFrom.
	tx, ok := postgres.TxFromContext(ctx)
	if !ok { // a server deployed without WithAtomicMethods: Unavailable releases the key
		return nil, status.Error(codes.Unavailable, "CreateCharge must run in atomic mode")
	}
	c := &paymentsv1.Charge{Id: "ch_" + idemkey.NewKey(), Amount: req.GetAmount(), Currency: req.GetCurrency()}
	_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)`,
		c.Id, c.Amount, c.Currency)
	if err != nil { // Unavailable releases the key: everything rolls back, and a retry runs again
		return nil, status.Error(codes.Unavailable, "charge not written")
	}
	return c, nil
}

// end readme
