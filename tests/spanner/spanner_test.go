package spanner_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"

	"github.com/idemkey/idemkey/store"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
	"github.com/idemkey/idemkey/store/storetest"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// newStore is a store on a database of its own, migrated, and its client.
func newStore(t *testing.T, opts ...idemspanner.Option) (*idemspanner.Store, *spanner.Client) {
	t.Helper()
	st, client, _, _ := newStoreDB(t, opts...)
	return st, client
}

// newStoreDB is newStore, with the database's admin client and name.
func newStoreDB(t *testing.T, opts ...idemspanner.Option) (*idemspanner.Store, *spanner.Client, *database.DatabaseAdminClient, string) {
	t.Helper()
	db, admin := spannertest.Database(t)
	if err := idemspanner.Migrate(t.Context(), admin, db, opts...); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	client := spannertest.Client(t, db)
	st, err := idemspanner.New(client, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return st, client, admin, db
}

// shift moves every record and step back by d, as if d had passed on
// Spanner's clock, which no test can set.
func shift(t *testing.T, client *spanner.Client, table string, d time.Duration) {
	t.Helper()
	_, err := client.ReadWriteTransaction(t.Context(), func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		us := map[string]any{"us": d.Microseconds()}
		_, err := txn.BatchUpdate(ctx, []spanner.Statement{
			{SQL: "UPDATE " + table + " SET lease_end = TIMESTAMP_SUB(lease_end, INTERVAL @us MICROSECOND), " +
				"created_at = TIMESTAMP_SUB(created_at, INTERVAL @us MICROSECOND), " +
				"expires_at = TIMESTAMP_SUB(expires_at, INTERVAL @us MICROSECOND) WHERE true", Params: us},
			{SQL: "UPDATE " + table + "_steps SET expires_at = TIMESTAMP_SUB(expires_at, INTERVAL @us MICROSECOND) WHERE true", Params: us},
		})
		return err
	})
	if err != nil {
		t.Fatalf("shift the records back by %v: %v", d, err)
	}
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		st, client := newStore(t)
		return storetest.Harness{Store: st, ShiftsRecords: true, Advance: func(t *testing.T, d time.Duration) {
			shift(t, client, idemspanner.DefaultTable, d)
		}}
	})
}

// A database that was never migrated fails the first call closed, and the
// error names the fix.
func TestNotMigrated(t *testing.T) {
	db, _ := spannertest.Database(t)
	st, err := idemspanner.New(spannertest.Client(t, db))
	if err != nil {
		t.Fatal(err)
	}
	_, err = st.Reserve(t.Context(), store.Reservation{Key: store.ScopeKey("t", "/m", "k"), Lease: time.Minute, Retention: time.Hour})
	if err == nil || !strings.Contains(err.Error(), "Migrate") {
		t.Fatalf("Reserve on a database without the table = %v; want an error that names Migrate", err)
	}
}

// Migrate is safe to run again, and WithTable names the tables.
func TestMigrateAgain(t *testing.T) {
	db, admin := spannertest.Database(t)
	for range 2 {
		if err := idemspanner.Migrate(t.Context(), admin, db, idemspanner.WithTable("keys_of_payments")); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
	}
	st, err := idemspanner.New(spannertest.Client(t, db), idemspanner.WithTable("keys_of_payments"))
	if err != nil {
		t.Fatal(err)
	}
	key := store.ScopeKey("t", "/m", "k")
	res, err := st.Reserve(t.Context(), store.Reservation{Key: key, Lease: time.Minute, Retention: time.Hour})
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve = %v, %v; want acquired", res.State, err)
	}
	if _, err := idemspanner.New(nil); err == nil {
		t.Error("New(nil) succeeded")
	}
	if _, err := idemspanner.New(spannertest.Client(t, db), idemspanner.WithTable("keys; DROP")); err == nil {
		t.Error("New with a table name that is no identifier succeeded")
	}
}
