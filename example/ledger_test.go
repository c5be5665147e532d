package example_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey/example"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// t0 is the create_time of the test charges, whole microseconds as
// PostgreSQL keeps them.
var t0 = time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)

func testCharge(id, customer string, created time.Time) *paymentsv1.Charge {
	return &paymentsv1.Charge{Id: id, CustomerId: customer, Amount: 100, Currency: "EUR", CreateTime: timestamppb.New(created)}
}

func insert(t testing.TB, l example.Ledger, tenant string, charges ...*paymentsv1.Charge) {
	t.Helper()
	for _, c := range charges {
		if err := l.Insert(context.Background(), tenant, c); err != nil {
			t.Fatalf("insert %s: %v", c.GetId(), err)
		}
	}
}

func ids(charges []*paymentsv1.Charge) []string {
	var out []string
	for _, c := range charges {
		out = append(out, c.GetId())
	}
	return out
}

// Every ledger lists a customer's charges by create_time, then id, whatever
// order they were inserted in, and pages through them from any position.
func TestLedgerList(t *testing.T) { forEachBackend(t, testLedgerList) }

func testLedgerList(t *testing.T, b backend) {
	ctx := context.Background()
	// Inserted out of order, as concurrent calls may insert them; ch_b and
	// ch_c share a create_time.
	insert(t, b.ledger, "acme",
		testCharge("ch_c", "cus_1", t0.Add(time.Second)),
		testCharge("ch_d", "cus_1", t0.Add(2*time.Second)),
		testCharge("ch_a", "cus_1", t0),
		testCharge("ch_b", "cus_1", t0.Add(time.Second)),
		testCharge("ch_x", "cus_2", t0),
	)
	insert(t, b.ledger, "globex", testCharge("ch_y", "cus_1", t0))
	want := []string{"ch_a", "ch_b", "ch_c", "ch_d"}

	all, next, err := b.ledger.List(ctx, "acme", "cus_1", example.Position{}, 10)
	if got := ids(all); err != nil || !slices.Equal(got, want) || !next.IsZero() {
		t.Fatalf("List(start, 10) = %v, %v, %v; want %v and no next page", got, next, err, want)
	}
	for limit := 1; limit <= len(want); limit++ {
		var got []string
		after := example.Position{}
		for page := 0; ; page++ {
			charges, next, err := b.ledger.List(ctx, "acme", "cus_1", after, limit)
			if err != nil || page > len(want) {
				t.Fatalf("limit %d, page %d: %v", limit, page, err)
			}
			if len(charges) > limit {
				t.Errorf("limit %d: a page of %d", limit, len(charges))
			}
			got = append(got, ids(charges)...)
			if next.IsZero() {
				break
			}
			after = next
		}
		if !slices.Equal(got, want) {
			t.Errorf("limit %d: pages hold %v, want %v", limit, got, want)
		}
	}
}

// The memory ledger keeps each index true: a merchant_reference is unique per
// tenant only, and Get finds only the tenant's own charges.
func TestMemoryLedgerIndexes(t *testing.T) {
	ctx := context.Background()
	l := example.NewMemoryLedger()
	withRef := func(id, ref string) *paymentsv1.Charge {
		c := testCharge(id, "cus_1", t0)
		c.MerchantReference = ref
		return c
	}
	insert(t, l, "acme", withRef("ch_1", "order-1"), withRef("ch_2", ""), withRef("ch_3", ""))
	insert(t, l, "globex", withRef("ch_4", "order-1"))
	if err := l.Insert(ctx, "acme", withRef("ch_5", "order-1")); status.Code(err) != codes.AlreadyExists {
		t.Errorf("acme's second order-1: %v, want AlreadyExists", err)
	}
	if c, err := l.Get(ctx, "acme", "ch_3"); err != nil || c.GetId() != "ch_3" {
		t.Errorf("Get(acme, ch_3) = %v, %v", c, err)
	}
	if _, err := l.Get(ctx, "globex", "ch_1"); status.Code(err) != codes.NotFound {
		t.Errorf("globex getting acme's charge: %v, want NotFound", err)
	}
	charges, _, err := l.List(ctx, "acme", "cus_1", example.Position{}, 10)
	if got := ids(charges); err != nil || !slices.Equal(got, []string{"ch_1", "ch_2", "ch_3"}) {
		t.Errorf("acme's charges = %v, %v; want the refused ch_5 left out", got, err)
	}
}

// BenchmarkMemoryLedgerInsert inserts charges with a merchant_reference into a
// tenant that holds between n and 2n of them, for one customer, for n of 1k
// and 100k: with every lookup indexed, an insert takes as long at either size.
func BenchmarkMemoryLedgerInsert(b *testing.B) {
	ctx := context.Background()
	newCharge := func(i int) *paymentsv1.Charge {
		c := testCharge(fmt.Sprint("ch_", i), "cus_1", t0.Add(time.Duration(i)*time.Microsecond))
		c.MerchantReference = fmt.Sprint("order-", i)
		return c
	}
	for _, n := range []int{1_000, 100_000} {
		b.Run(fmt.Sprint("charges=", n), func(b *testing.B) {
			var l *example.MemoryLedger
			i := 0
			for b.Loop() {
				if i%n == 0 { // start again from n charges
					b.StopTimer()
					l = example.NewMemoryLedger()
					for j := range n {
						insert(b, l, "acme", newCharge(j))
					}
					i = n
					b.StartTimer()
				}
				if err := l.Insert(ctx, "acme", newCharge(i)); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}
