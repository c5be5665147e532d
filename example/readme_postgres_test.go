package example_test

// This file is docs/stores.md's PostgreSQL snippet, between the markers;
// the page's copy must match it (TestREADMESnippets).

// readme:postgres
import (
	"context"
	"net"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// servePostgres serves on lis until ctx ends, with the keys in PostgreSQL
// at databaseURL ("postgres://user@host:5432/db").
func servePostgres(ctx context.Context, lis net.Listener, databaseURL string) error {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := postgres.Migrate(ctx, pool); err != nil { // or feed postgres.Migrations to your migration tool
		return err
	}
	st, err := postgres.New(pool)
	if err != nil {
		return err
	}
	go (&store.Janitor{Store: st}).Run(ctx) // deletes expired keys every minute
	go st.Listen(ctx)                       // answers a duplicate of a running call the moment it is recorded

	eng, err := engine.New(st, engine.WithTenant(callerTenant), engine.WithKeyRequired())
	if err != nil {
		return err
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, payments{})
	go func() { <-ctx.Done(); srv.GracefulStop() }()
	return srv.Serve(lis)
}

// end readme
