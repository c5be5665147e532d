package example_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// migratedPool returns a pool on schema with the store's and the ledger's
// tables created, as the example server does at start-up.
func migratedPool(t testing.TB, schema string) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, schema)
	ctx := context.Background()
	if err := postgres.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := example.MigrateLedger(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

func postgresBackend(t testing.TB, pool *pgxpool.Pool, atomic bool) backend {
	t.Helper()
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return backend{st, example.NewPostgresLedger(pool), atomic}
}

// replica starts one example server process's worth of state on schema: its
// own pool (whose sessions are named app), store and gRPC server. The client
// it returns does not retry, so that each status is seen as the server sent
// it.
func replica(t *testing.T, schema, app string, atomic bool, delay time.Duration) (paymentsv1.PaymentServiceClient, func()) {
	t.Helper()
	b := postgresBackend(t, pgtest.Pool(t, schema, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app }), atomic)
	srv, _, _ := example.NewServer(grpctest.Must(example.NewEngine(b.store)), example.Config{Ledger: b.ledger, HandlerDelay: delay, Atomic: b.atomic})
	conn := grpctest.Dial(t, grpctest.Serve(t, srv))
	return paymentsv1.NewPaymentServiceClient(conn), func() { conn.Close(); srv.Stop() }
}

func withKey(tenant, key string) context.Context {
	return metadata.AppendToOutgoingContext(as(tenant), idemkey.KeyMetadata, key)
}

// Two servers on one database behave as one service: a duplicate sent to B
// while A runs the first call gets Aborted, then the replay of A's reply, and
// the reply survives a restart of both. In atomic mode nobody sees A's charge
// before A has recorded its reply.
func TestReplicasBehaveAsOne(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) { testReplicasBehaveAsOne(t, atomic) })
	}
}

func testReplicasBehaveAsOne(t *testing.T, atomic bool) {
	schema := pgtest.Schema(t)
	pool := migratedPool(t, schema)
	app := "idemkey_test_" + strings.ReplaceAll(t.Name(), "/", "_")
	// A's handler outlasts the duplicate's wait (engine.DefaultInProgressWait)
	// with room to spare on a busy machine.
	a, stopA := replica(t, schema, app, atomic, engine.DefaultInProgressWait+3*time.Second)
	b, stopB := replica(t, schema, "", atomic, 0)
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	key := idemkey.NewKey()

	type reply struct {
		charge *paymentsv1.Charge
		err    error
	}
	first := make(chan reply, 1)
	go func() {
		c, err := a.CreateCharge(withKey("acme", key), req)
		first <- reply{c, err}
	}()
	// A has written the charge and is still in its handler: in atomic mode,
	// its session is idle in the open transaction.
	inHandler := func() bool { return countCharges(t, pool) == 1 }
	if atomic {
		inHandler = func() bool {
			var n int
			err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND state = 'idle in transaction'`, app).Scan(&n)
			if err != nil {
				t.Fatal(err)
			}
			return n == 1
		}
	}
	for deadline := time.Now().Add(10 * time.Second); !inHandler(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("replica A never wrote the charge")
		}
	}
	// The server holds a duplicate for the first call's outcome for its
	// in-progress wait, then answers it in progress, while A still runs; the
	// duplicate's deadline leaves the answer seconds to arrive.
	ctx, cancel := context.WithTimeout(withKey("acme", key), engine.DefaultInProgressWait+2*time.Second)
	defer cancel()
	_, err := b.CreateCharge(ctx, req)
	if status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate on replica B during A's call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
	}
	if n := countCharges(t, pool); atomic && n != 0 {
		t.Errorf("%d charges visible during A's atomic call, want 0 until it commits", n)
	}
	r := <-first
	if r.err != nil {
		t.Fatalf("first call on replica A: %v", r.err)
	}
	wantReplay := func(client paymentsv1.PaymentServiceClient, who string) {
		t.Helper()
		var trailer metadata.MD
		got, err := client.CreateCharge(withKey("acme", key), req, grpc.Trailer(&trailer))
		if err != nil || !proto.Equal(got, r.charge) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Errorf("retry on %s = %v, %v (replayed %v); want A's charge %v, replayed", who, got, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), r.charge)
		}
	}
	wantReplay(b, "replica B")

	stopA()
	stopB()
	c, _ := replica(t, schema, "", atomic, 0)
	wantReplay(c, "a restarted replica")
	if n := countCharges(t, pool); n != 1 {
		t.Errorf("%d charges in the database, want 1", n)
	}
}

// After a key has expired (or with a new key), the database's unique
// merchant_reference per tenant still refuses a second charge, in either
// mode.
func TestMerchantReferenceOutlivesKeys(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) { testMerchantReferenceOutlivesKeys(t, atomic) })
	}
}

func testMerchantReferenceOutlivesKeys(t *testing.T, atomic bool) {
	schema := pgtest.Schema(t)
	pool := migratedPool(t, schema)
	client, _ := replica(t, schema, "", atomic, 0)
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR", MerchantReference: "order-1"}
	key := idemkey.NewKey()
	if _, err := client.CreateCharge(withKey("acme", key), req); err != nil {
		t.Fatal(err)
	}
	// Expire every key: shift the records' times a day into the past.
	if _, err := pool.Exec(context.Background(), `UPDATE idempotency_keys SET
		created_at = created_at - interval '25 hours', expires_at = expires_at - interval '25 hours', lease_end = lease_end - interval '25 hours'`); err != nil {
		t.Fatal(err)
	}
	_, err := client.CreateCharge(withKey("acme", key), req)
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("same key after expiry: %v, want AlreadyExists from the unique merchant_reference", err)
	}
	if _, err := client.CreateCharge(withKey("globex", key), req); err != nil {
		t.Errorf("another tenant's order-1: %v", err)
	}
	if n := countCharges(t, pool); n != 2 {
		t.Errorf("%d charges, want 2 (one per tenant)", n)
	}
}

// Replicas starting together on an empty database all create the ledger.
func TestMigrateLedgerConcurrently(t *testing.T) {
	for range 5 {
		pool := pgtest.Pool(t, pgtest.Schema(t))
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				if err := example.MigrateLedger(context.Background(), pool); err != nil {
					t.Errorf("concurrent MigrateLedger: %v", err)
				}
			})
		}
		wg.Wait()
	}
}

func countCharges(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM charges`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A charge's insert ends by the call's deadline, which its idempotency lease
// outlasts: a call whose deadline has passed makes no charge, even though
// the insert ignores the caller's cancellation.
func TestInsertEndsByTheCallsDeadline(t *testing.T) {
	pool := migratedPool(t, pgtest.Schema(t))
	ledger := example.NewPostgresLedger(pool)
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	err := ledger.Insert(ctx, "acme", testCharge("ch_late", "cus_1", t0))
	if status.Code(err) != codes.Unavailable {
		t.Errorf("insert after the call's deadline: %v, want Unavailable (no charge made, the key released)", err)
	}
	if n := countCharges(t, pool); n != 0 {
		t.Errorf("%d charges after the call's deadline, want 0", n)
	}
}

// A charges table of an earlier release, without processor_charge_id,
// gets the column, empty for its charges, and keeps them.
func TestMigrateLedgerAddsProcessorChargeID(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (tenant text NOT NULL, id text NOT NULL, customer_id text NOT NULL,
		amount bigint NOT NULL, currency text NOT NULL, description text NOT NULL, merchant_reference text,
		create_time timestamptz NOT NULL, PRIMARY KEY (tenant, id));
		INSERT INTO charges VALUES ('acme', 'ch_old', 'cus_1', 100, 'EUR', '', NULL, now())`); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := example.MigrateLedger(ctx, pool); err != nil {
			t.Fatalf("MigrateLedger on an earlier table: %v", err)
		}
	}
	c, err := example.NewPostgresLedger(pool).Get(ctx, "acme", "ch_old")
	if err != nil || c.GetProcessorChargeId() != "" {
		t.Errorf("the earlier charge: %v, %v; want it with no processor_charge_id", c, err)
	}
}
