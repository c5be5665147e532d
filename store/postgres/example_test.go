package postgres_test

import (
	"context"
	"log"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// A server on PostgreSQL: create or upgrade the table at start-up, build the
// engine on the store and put it behind the interceptor, and sweep expired
// keys in a goroutine that stops with the server.
func Example() {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	pool, err := pgxpool.New(ctx, "postgres://app@db.internal/payments")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := postgres.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	st, err := postgres.New(pool, postgres.WithTimeout(2*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	go (&store.Janitor{Store: st, Interval: time.Minute}).Run(ctx)

	// tenantOf reads the caller's tenant from the identity that the
	// authentication interceptor verified.
	eng, err := engine.New(st, engine.WithTenant(tenantOf))
	if err != nil {
		log.Fatal(err)
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idem))
	_ = srv // register services, then srv.Serve(lis)
}
