package example

import (
	"context"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// ShardedLedger is a Ledger over one PostgresLedger per shard of the
// idemkey store (store/pgshard), each tenant's charges on its shard: in
// atomic mode a charge's INSERT joins the call's transaction, which is on
// that shard, and commits with its recorded reply.
type ShardedLedger struct {
	shards  []*PostgresLedger
	shardOf func(tenant string) int
}

// NewShardedLedger returns a ledger that keeps tenant's charges in
// shards[shardOf(tenant)] (pgshard.Store.ShardOf).
func NewShardedLedger(shards []*PostgresLedger, shardOf func(tenant string) int) *ShardedLedger {
	return &ShardedLedger{shards: shards, shardOf: shardOf}
}

// Insert implements Ledger on tenant's shard.
func (l *ShardedLedger) Insert(ctx context.Context, tenant string, c *paymentsv1.Charge) error {
	return l.shards[l.shardOf(tenant)].Insert(ctx, tenant, c)
}

// Get implements Ledger on tenant's shard.
func (l *ShardedLedger) Get(ctx context.Context, tenant, id string) (*paymentsv1.Charge, error) {
	return l.shards[l.shardOf(tenant)].Get(ctx, tenant, id)
}

// List implements Ledger on tenant's shard.
func (l *ShardedLedger) List(ctx context.Context, tenant, customerID string, after Position, limit int) ([]*paymentsv1.Charge, Position, error) {
	return l.shards[l.shardOf(tenant)].List(ctx, tenant, customerID, after, limit)
}
