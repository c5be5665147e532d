package example

import (
	"context"
	"sync"

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
	// List returns the tenant's charges for a customer, oldest first.
	List(ctx context.Context, tenant, customerID string) ([]*paymentsv1.Charge, error)
}

// MemoryLedger is a Ledger in memory, for a server without a database.
type MemoryLedger struct {
	mu      sync.Mutex
	charges map[string][]*paymentsv1.Charge // by tenant, oldest first
}

// NewMemoryLedger returns an empty ledger.
func NewMemoryLedger() *MemoryLedger {
	return &MemoryLedger{charges: make(map[string][]*paymentsv1.Charge)}
}

// Insert implements Ledger.
func (l *MemoryLedger) Insert(_ context.Context, tenant string, c *paymentsv1.Charge) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ref := c.GetMerchantReference(); ref != "" {
		for _, old := range l.charges[tenant] {
			if old.GetMerchantReference() == ref {
				return errDuplicateReference
			}
		}
	}
	l.charges[tenant] = append(l.charges[tenant], c)
	return nil
}

// Get implements Ledger.
func (l *MemoryLedger) Get(_ context.Context, tenant, id string) (*paymentsv1.Charge, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.charges[tenant] {
		if c.GetId() == id {
			return c, nil
		}
	}
	return nil, errNoSuchCharge
}

// List implements Ledger.
func (l *MemoryLedger) List(_ context.Context, tenant, customerID string) ([]*paymentsv1.Charge, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*paymentsv1.Charge
	for _, c := range l.charges[tenant] {
		if c.GetCustomerId() == customerID {
			out = append(out, c)
		}
	}
	return out, nil
}
