package spanner_test

import (
	"context"
	"errors"
	"log"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"

	"github.com/idemkey/idemkey/engine"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// A server on Spanner: Migrate creates the store's tables, and the engine
// on the store serves every entry point; an atomic method's handler writes
// through the call's transaction. It needs a Spanner database (or the
// emulator), so it is compiled but not run: tests/spanner runs the store's
// tests on the emulator.
func Example() {
	ctx := context.Background()
	db := "projects/acme/instances/payments/databases/payments"
	admin, err := database.NewDatabaseAdminClient(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer admin.Close()
	if err := idemspanner.Migrate(ctx, admin, db); err != nil {
		log.Fatal(err)
	}
	client, err := spanner.NewClient(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	st, err := idemspanner.New(client)
	if err != nil {
		log.Fatal(err)
	}
	eng, err := engine.New(st, engine.WithTenant(tenantOf))
	if err != nil {
		log.Fatal(err)
	}
	_ = eng // then interceptor.UnaryServerInterceptor(eng, interceptor.WithAtomicMethods(...)), ...
}

// createCharge is an atomic method's handler: its insert commits with the
// key's record, or not at all.
func createCharge(ctx context.Context, tenant, id string, amount int64) error {
	txn, ok := idemspanner.TxFromContext(ctx)
	if !ok {
		return errors.New("not an atomic call")
	}
	_, err := txn.Update(ctx, spanner.Statement{
		SQL:    "INSERT INTO charges (tenant, id, amount) VALUES (@tenant, @id, @amount)",
		Params: map[string]any{"tenant": tenant, "id": id, "amount": amount},
	})
	return err // Spanner's own error: Aborted is released, and the client retries
}

var _ = createCharge

func tenantOf(ctx context.Context) (string, error) { return "acme", nil }
