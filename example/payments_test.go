package example_test

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// backend is where the example server keeps its keys and charges.
type backend struct {
	store  store.Store
	ledger example.Ledger
	atomic bool // CreateCharge in atomic mode
}

// backends are the ways the example server runs.
var backends = []struct {
	name string
	open func(t *testing.T) backend
}{
	{"memory", func(*testing.T) backend { return backend{store: memory.New(), ledger: example.NewMemoryLedger()} }},
	{"postgres", func(t *testing.T) backend { return postgresBackend(t, migratedPool(t, pgtest.Schema(t)), false) }},
	{"postgres-atomic", func(t *testing.T) backend { return postgresBackend(t, migratedPool(t, pgtest.Schema(t)), true) }},
}

// forEachBackend runs test as a subtest per backend.
func forEachBackend(t *testing.T, test func(t *testing.T, b backend)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) { test(t, b.open(t)) })
	}
}

// newClient serves the example on b and returns a client with the idemkey
// client interceptor and the example's retry policy.
func newClient(t *testing.T, b backend) (paymentsv1.PaymentServiceClient, *grpc.ClientConn) {
	t.Helper()
	srv, _ := example.NewServer(b.store, example.Config{Ledger: b.ledger, Atomic: b.atomic})
	conn := grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDefaultServiceConfig(example.ServiceConfig),
		grpc.WithUnaryInterceptor(interceptor.UnaryClientInterceptor()))
	return paymentsv1.NewPaymentServiceClient(conn), conn
}

func as(tenant string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_"+tenant)
}

func TestAuthentication(t *testing.T) {
	client, conn := newClient(t, backend{store: memory.New(), ledger: example.NewMemoryLedger()})
	for name, ctx := range map[string]context.Context{
		"none":    context.Background(),
		"unknown": metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_live_nope"),
		"scheme":  metadata.AppendToOutgoingContext(context.Background(), "authorization", "Basic sk_test_acme"),
	} {
		if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s: %v, want Unauthenticated", name, err)
		}
	}
	// The health service needs no credentials and no key.
	if _, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health check: %v", err)
	}
}

// An invalid request releases its key, so the corrected request may reuse it.
func TestInvalidRequestReleasesKey(t *testing.T) { forEachBackend(t, testInvalidRequestReleasesKey) }

func testInvalidRequestReleasesKey(t *testing.T, b backend) {
	client, _ := newClient(t, b)
	ctx := as("acme")
	key := idemkey.NewKey()
	for _, bad := range []*paymentsv1.CreateChargeRequest{
		{Amount: 100, Currency: "EUR"},
		{CustomerId: "cus_1", Amount: 0, Currency: "EUR"},
		{CustomerId: "cus_1", Amount: 100, Currency: "eur"},
	} {
		if _, err := client.CreateCharge(ctx, bad, interceptor.UseKey(key)); status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != "" {
			t.Errorf("%v: %v, want the service's InvalidArgument", bad, err)
		}
	}
	if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}, interceptor.UseKey(key)); err != nil {
		t.Errorf("corrected request with the same key: %v", err)
	}
}

func TestTenantsAreSeparate(t *testing.T) { forEachBackend(t, testTenantsAreSeparate) }

func testTenantsAreSeparate(t *testing.T, b backend) {
	client, _ := newClient(t, b)
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR", MerchantReference: "order-1"}
	key := idemkey.NewKey()
	acme, err := client.CreateCharge(as("acme"), req, interceptor.UseKey(key))
	if err != nil {
		t.Fatal(err)
	}
	// The same key and merchant reference are another tenant's own.
	globex, err := client.CreateCharge(as("globex"), req, interceptor.UseKey(key))
	if err != nil {
		t.Fatal(err)
	}
	if acme.GetId() == globex.GetId() {
		t.Error("two tenants with one key got the same charge")
	}
	if _, err := client.GetCharge(as("globex"), &paymentsv1.GetChargeRequest{Id: acme.GetId()}); status.Code(err) != codes.NotFound {
		t.Errorf("globex reading acme's charge: %v, want NotFound", err)
	}
	list, err := client.ListCharges(as("acme"), &paymentsv1.ListChargesRequest{CustomerId: "cus_1"})
	if err != nil || len(list.GetCharges()) != 1 || list.GetCharges()[0].GetId() != acme.GetId() {
		t.Errorf("acme's charges = %v, %v; want only its own", list.GetCharges(), err)
	}
	// A new key with a used merchant reference is refused by the business rule.
	if _, err := client.CreateCharge(as("acme"), req); status.Code(err) != codes.AlreadyExists {
		t.Errorf("second charge with order-1: %v, want AlreadyExists", err)
	}
}
