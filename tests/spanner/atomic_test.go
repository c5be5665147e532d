package spanner_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"

	"github.com/idemkey/idemkey/store"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// chargesDDL is the handler's own table in the atomic tests.
const chargesDDL = "CREATE TABLE charges (id STRING(64) NOT NULL, amount INT64 NOT NULL) PRIMARY KEY (id)"

func createCharges(t *testing.T, admin *database.DatabaseAdminClient, db string) {
	t.Helper()
	op, err := admin.UpdateDatabaseDdl(t.Context(), &databasepb.UpdateDatabaseDdlRequest{Database: db, Statements: []string{chargesDDL}})
	if err == nil {
		err = op.Wait(t.Context())
	}
	if err != nil {
		t.Fatalf("create the charges table: %v", err)
	}
}

// charges reads the charges table: id to amount.
func charges(t *testing.T, client *spanner.Client) map[string]int64 {
	t.Helper()
	got := map[string]int64{}
	err := client.Single().Query(t.Context(), spanner.Statement{SQL: "SELECT id, amount FROM charges"}).Do(func(row *spanner.Row) error {
		var (
			id     string
			amount int64
		)
		if err := row.Columns(&id, &amount); err != nil {
			return err
		}
		got[id] = amount
		return nil
	})
	if err != nil {
		t.Fatalf("read the charges: %v", err)
	}
	return got
}

// charge is an atomic handler: it writes one charge row through the call's
// transaction.
func charge(ctx context.Context, id string, amount int64) error {
	txn, ok := idemspanner.TxFromContext(ctx)
	if !ok {
		return errors.New("no transaction in the handler's context")
	}
	_, err := txn.Update(ctx, spanner.Statement{
		SQL:    "INSERT INTO charges (id, amount) VALUES (@id, @amount)",
		Params: map[string]any{"id": id, "amount": amount},
	})
	return err
}

var fp = store.Fingerprint{7}

func reservation(key store.Key) store.Reservation {
	return store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: time.Hour}
}

// A handler whose transaction aborts under it (a concurrent write of the
// same row) commits nothing: no record, no charge; the commit says the
// store was unavailable, which the engine answers so that the client
// retries, and the retry runs the handler once and records.
func TestAtomicAborted(t *testing.T) {
	st, client := newAtomicStore(t)
	ctx := t.Context()
	key := store.ScopeKey("tenant", "/m", "k")

	res, tx, err := st.Begin(ctx, reservation(key))
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin = %v, %v; want acquired", res.State, err)
	}
	hctx := tx.HandlerContext(ctx)
	if err := charge(hctx, "ch_1", 100); err != nil {
		t.Fatalf("the handler's write: %v", err)
	}
	// Another writer of the same row, outside the call, commits first.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := client.Apply(wctx, []*spanner.Mutation{spanner.InsertOrUpdate("charges", []string{"id", "amount"}, []any{"ch_1", int64(1)})}); err != nil {
		t.Logf("the concurrent write failed: %v", err)
	}
	err = tx.Commit(ctx, []byte("reply"), true)
	t.Logf("Commit after the concurrent write: %v", err)
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Commit of an aborted transaction = %v; want store.ErrUnavailable", err)
	}
	if _, ok, err := st.Find(ctx, key); err != nil || ok {
		t.Fatalf("Find after the aborted commit = found %v, %v; want no record", ok, err)
	}
	if got := charges(t, client); got["ch_1"] != 1 {
		t.Fatalf("charges after the aborted commit = %v; want only the other writer's ch_1 = 1", got)
	}

	// The client's retry: acquired at once (released), runs once, records.
	res, tx, err = st.Begin(ctx, reservation(key))
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Begin of the retry = %v, %v; want acquired", res.State, err)
	}
	if err := charge(tx.HandlerContext(ctx), "ch_2", 100); err != nil {
		t.Fatalf("the retry's write: %v", err)
	}
	if err := tx.Commit(ctx, []byte("reply"), true); err != nil {
		t.Fatalf("Commit of the retry: %v", err)
	}
	if got := charges(t, client); len(got) != 2 || got["ch_2"] != 100 {
		t.Fatalf("charges after the retry = %v; want ch_1 = 1 and the retry's ch_2 = 100", got)
	}
	if res, err := st.Reserve(ctx, reservation(key)); err != nil || res.State != store.Completed || string(res.Outcome) != "reply" {
		t.Fatalf("Reserve after the retry = %v %q, %v; want completed with the reply", res.State, res.Outcome, err)
	}
}

// newAtomicStore is newStore with the handler's table of charges.
func newAtomicStore(t *testing.T) (*idemspanner.Store, *spanner.Client) {
	t.Helper()
	st, client, admin, db := newStoreDB(t)
	createCharges(t, admin, db)
	return st, client
}
