package example_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

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
	srv, _, _ := example.NewServer(grpctest.Must(example.NewEngine(b.store)), example.Config{Ledger: b.ledger, Atomic: b.atomic})
	conn := grpctest.Dial(t, grpctest.Serve(t, srv), grpc.WithDefaultServiceConfig(example.ServiceConfig),
		grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor())))
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

// ListCharges pages through a customer's charges (AIP-158): page_size 0 gets
// 50, more than 1000 gets 1000, and the pages hold every charge once.
func TestListChargesPages(t *testing.T) { forEachBackend(t, testListChargesPages) }

func testListChargesPages(t *testing.T, b backend) {
	client, _ := newClient(t, b)
	var want []string
	for i := range 1001 {
		c := testCharge(fmt.Sprintf("ch_%04d", i), "cus_1", t0.Add(time.Duration(i/2)*time.Millisecond)) // in pairs of one create_time
		insert(t, b.ledger, "acme", c)
		want = append(want, c.GetId())
	}
	insert(t, b.ledger, "acme", testCharge("ch_other", "cus_2", t0))

	cases := []struct {
		pageSize int32
		pages    []int // each page's length
	}{
		{0, append(slices.Repeat([]int{50}, 20), 1)},
		{400, []int{400, 400, 201}},
		{1000, []int{1000, 1}},
		{5000, []int{1000, 1}},
	}
	for _, tc := range cases {
		req := &paymentsv1.ListChargesRequest{CustomerId: "cus_1", PageSize: tc.pageSize}
		var got []string
		var pages []int
		for len(pages) <= len(tc.pages) {
			resp, err := client.ListCharges(as("acme"), req)
			if err != nil {
				t.Fatalf("page_size %d, page %d: %v", tc.pageSize, len(pages)+1, err)
			}
			got = append(got, ids(resp.GetCharges())...)
			pages = append(pages, len(resp.GetCharges()))
			if resp.GetNextPageToken() == "" {
				break
			}
			req.PageToken = resp.GetNextPageToken()
		}
		if !slices.Equal(pages, tc.pages) {
			t.Errorf("page_size %d: pages of %v charges, want %v", tc.pageSize, pages, tc.pages)
		}
		if !slices.Equal(got, want) {
			t.Errorf("page_size %d: the pages do not hold each charge once, in order", tc.pageSize)
		}
	}
}

// A negative page_size, or a page token that is malformed or was issued for
// another customer, is refused without repeating the token.
func TestListChargesRefusesBadPages(t *testing.T) { forEachBackend(t, testListChargesRefusesBadPages) }

func testListChargesRefusesBadPages(t *testing.T, b backend) {
	client, _ := newClient(t, b)
	for i := range 3 {
		insert(t, b.ledger, "acme", testCharge(fmt.Sprint("ch_", i), "cus_1", t0))
	}
	first, err := client.ListCharges(as("acme"), &paymentsv1.ListChargesRequest{CustomerId: "cus_1", PageSize: 1})
	if err != nil || first.GetNextPageToken() == "" {
		t.Fatalf("first page: %v, %v; want a next page", first, err)
	}
	token := first.GetNextPageToken()
	// edit returns token with its bytes changed by f (see pagetoken.go).
	edit := func(f func(raw []byte) []byte) string {
		raw, err := base64.RawURLEncoding.DecodeString(token)
		if err != nil {
			t.Fatalf("the token is not base64url: %v", err)
		}
		return base64.RawURLEncoding.EncodeToString(f(raw))
	}
	withID := func(id string) string {
		return edit(func(raw []byte) []byte { return append(raw[:len(raw)-len("ch_0")], id...) })
	}
	setByte := func(i int, v byte) string {
		return edit(func(raw []byte) []byte { raw[i] = v; return raw })
	}
	if withID("ch_0") != token {
		t.Fatal("the token does not end with the id of the page's last charge")
	}
	for name, req := range map[string]*paymentsv1.ListChargesRequest{
		"negative page_size":   {CustomerId: "cus_1", PageSize: -1},
		"not base64url":        {CustomerId: "cus_1", PageToken: "not a token!"},
		"too short":            {CustomerId: "cus_1", PageToken: token[:20]},
		"another customer_id":  {CustomerId: "cus_2", PageToken: token},
		"id not UTF-8":         {CustomerId: "cus_1", PageToken: withID("ch_\xff")},
		"id with NUL":          {CustomerId: "cus_1", PageToken: withID("ch_\x00")},
		"no id":                {CustomerId: "cus_1", PageToken: withID("")},
		"before 1970":          {CustomerId: "cus_1", PageToken: setByte(0, 0xff)},
		"after 9999":           {CustomerId: "cus_1", PageToken: setByte(0, 0x7f)},
		"nanoseconds over 1e9": {CustomerId: "cus_1", PageToken: setByte(8, 0xff)},
	} {
		_, err := client.ListCharges(as("acme"), req)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
		if msg := status.Convert(err).Message(); req.GetPageToken() != "" && strings.Contains(msg, req.GetPageToken()) {
			t.Errorf("%s: the message %q repeats the token", name, msg)
		}
	}
	// The same token with another page_size is fine (AIP-158).
	if rest, err := client.ListCharges(as("acme"), &paymentsv1.ListChargesRequest{CustomerId: "cus_1", PageSize: 10, PageToken: token}); err != nil || len(rest.GetCharges()) != 2 || rest.GetNextPageToken() != "" {
		t.Errorf("the rest with page_size 10 = %v, %v; want the last 2 charges", rest, err)
	}
}
