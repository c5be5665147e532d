package main

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// The consumer's charges pass the kit's redelivery chaos on memory and on
// PostgreSQL in both modes, whatever the broker (the kit is the consumer's
// broker, and redelivers what a broker would): every
// message delivered twice, out of order, and again during its handler,
// charges once; a declined card and an invalid body, none.
func TestKitRedelivery(t *testing.T) {
	for _, mode := range []string{"memory", "two-phase", "atomic"} {
		t.Run(mode, func(t *testing.T) {
			var (
				st     store.Store    = memory.New()
				ledger example.Ledger = example.NewMemoryLedger()
			)
			if mode != "memory" {
				pool := pgtest.Pool(t, pgtest.Schema(t))
				if err := postgres.Migrate(t.Context(), pool); err != nil {
					t.Fatal(err)
				}
				if err := example.MigrateLedger(t.Context(), pool); err != nil {
					t.Fatal(err)
				}
				pst, err := postgres.New(pool)
				if err != nil {
					t.Fatal(err)
				}
				st, ledger = pst, example.NewPostgresLedger(pool)
			}
			eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(slog.New(slog.DiscardHandler)))
			if err != nil {
				t.Fatal(err)
			}
			var opts []consumer.Option
			if mode == "atomic" {
				opts = append(opts, consumer.WithAtomic())
			}
			w := &worker{svc: example.NewService(ledger, 0), logger: slog.New(slog.DiscardHandler)}
			kit := idemtest.New(t, idemtest.Chaos{Effects: func(ctx context.Context) (int, error) {
				n := 0
				for _, customer := range []string{"cus_1", "cus_2", example.DeclinedCustomer} {
					charges, _, err := ledger.List(ctx, "acme", customer, example.Position{}, 1000)
					if err != nil {
						return 0, err
					}
					n += len(charges)
				}
				return n, nil
			}})
			var ds []consumer.Delivery
			for i, customer := range []string{"cus_1", "cus_2", example.DeclinedCustomer, "cus_1"} {
				body, err := protojson.Marshal(&paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 100, Currency: "EUR"})
				if err != nil {
					t.Fatal(err)
				}
				ds = append(ds, consumer.Delivery{ID: fmt.Sprintf("acme/order-%d", i), Tenant: "acme", Body: body, Attempt: 1})
			}
			ds = append(ds, consumer.Delivery{ID: "acme/order-bad", Tenant: "acme", Body: []byte("not json"), Attempt: 1})
			results := kit.Process(t.Context(), eng, "charges", ds, func(ctx context.Context, d consumer.Delivery) error {
				return w.charge(ctx, d.Tenant, d.Body)
			}, opts...)
			for i, want := range []consumer.Outcome{consumer.Processed, consumer.Processed, consumer.Failed, consumer.Processed, consumer.Failed} {
				if results[i].Outcome != want {
					t.Errorf("message %d: %s, want %s", i+1, results[i].Outcome, want)
				}
			}
		})
	}
}
