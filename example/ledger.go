package example

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// Errors a Ledger returns, as gRPC statuses for the service to pass on.
var (
	errDuplicateReference = status.Error(codes.AlreadyExists, "a charge with this merchant_reference exists")
	errNoSuchCharge       = status.Error(codes.NotFound, "no such charge")
)

// Ledger keeps each tenant's charges. A merchant_reference, when set, is
// unique per tenant: the business-level second line of defence, which still
// holds after an idempotency key has expired.
type Ledger interface {
	// Insert adds a charge, or fails with AlreadyExists if the tenant has a
	// charge with the same non-empty merchant_reference.
	Insert(ctx context.Context, tenant string, c *paymentsv1.Charge) error
	// Get returns one of the tenant's charges, or NotFound.
	Get(ctx context.Context, tenant, id string) (*paymentsv1.Charge, error)
	// List returns up to limit (at least 1) of the tenant's charges for a
	// customer that come after the position after, in the order of
	// Position. If more follow, next is the position of the last one
	// returned; otherwise it is the zero Position.
	List(ctx context.Context, tenant, customerID string, after Position, limit int) (charges []*paymentsv1.Charge, next Position, err error)
}

// Position is a place in a customer's charges, which are ordered by
// create_time, then by id. The zero Position is before the first charge.
type Position struct {
	CreateTime time.Time
	ID         string
}

// IsZero reports whether p is the zero Position.
func (p Position) IsZero() bool { return p == Position{} }

func positionOf(c *paymentsv1.Charge) Position {
	return Position{CreateTime: c.GetCreateTime().AsTime(), ID: c.GetId()}
}

func (p Position) compare(q Position) int {
	if c := p.CreateTime.Compare(q.CreateTime); c != 0 {
		return c
	}
	return cmp.Compare(p.ID, q.ID)
}

// MemoryLedger is a Ledger in memory, for a server without a database. Every
// call finds its charges through an index, so none slows down as a tenant's
// charges grow.
type MemoryLedger struct {
	mu         sync.Mutex
	byID       map[ledgerKey]*paymentsv1.Charge   // by tenant and id
	byRef      map[ledgerKey]*paymentsv1.Charge   // by tenant and non-empty merchant_reference
	byCustomer map[ledgerKey][]*paymentsv1.Charge // by tenant and customer_id, in Position order
}

// ledgerKey names a charge, or a customer's charges, within a tenant.
type ledgerKey struct{ tenant, name string }

// NewMemoryLedger returns an empty ledger.
func NewMemoryLedger() *MemoryLedger {
	return &MemoryLedger{
		byID:       make(map[ledgerKey]*paymentsv1.Charge),
		byRef:      make(map[ledgerKey]*paymentsv1.Charge),
		byCustomer: make(map[ledgerKey][]*paymentsv1.Charge),
	}
}

// Insert implements Ledger.
func (l *MemoryLedger) Insert(_ context.Context, tenant string, c *paymentsv1.Charge) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	ref := ledgerKey{tenant, c.GetMerchantReference()}
	if ref.name != "" {
		if _, ok := l.byRef[ref]; ok {
			return errDuplicateReference
		}
		l.byRef[ref] = c
	}
	l.byID[ledgerKey{tenant, c.GetId()}] = c
	// Charges mostly arrive in order, to be appended; one that overtook
	// another (its call was slower) is put in its place.
	customer := ledgerKey{tenant, c.GetCustomerId()}
	charges := l.byCustomer[customer]
	p := positionOf(c)
	if n := len(charges); n == 0 || positionOf(charges[n-1]).compare(p) < 0 {
		l.byCustomer[customer] = append(charges, c)
	} else {
		l.byCustomer[customer] = slices.Insert(charges, searchAfter(charges, p), c)
	}
	return nil
}

// Get implements Ledger.
func (l *MemoryLedger) Get(_ context.Context, tenant, id string) (*paymentsv1.Charge, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c, ok := l.byID[ledgerKey{tenant, id}]; ok {
		return c, nil
	}
	return nil, errNoSuchCharge
}

// List implements Ledger.
func (l *MemoryLedger) List(_ context.Context, tenant, customerID string, after Position, limit int) ([]*paymentsv1.Charge, Position, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	charges := l.byCustomer[ledgerKey{tenant, customerID}]
	charges = charges[searchAfter(charges, after):]
	if len(charges) <= limit {
		return slices.Clone(charges), Position{}, nil
	}
	page := slices.Clone(charges[:limit])
	return page, positionOf(page[limit-1]), nil
}

// searchAfter returns the index of the first of charges, in Position order,
// that comes after p.
func searchAfter(charges []*paymentsv1.Charge, p Position) int {
	i, _ := slices.BinarySearchFunc(charges, p, func(c *paymentsv1.Charge, p Position) int {
		if positionOf(c).compare(p) <= 0 {
			return -1
		}
		return 1
	})
	return i
}
