package postgres_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/store/storetest"
)

// storetestTenant is the tenant of every call of package storetest.
const storetestTenant = "tenant"

// TestShardedConformance runs the store suite on a pgshard store over three
// real databases (pgtest.ShardPools), once with the suite's tenant on each
// shard; every shard listens. It lives here, beside store/pgshard's own
// tests, because only this package's tests can move a shard's Watch clock
// with the database's (SetClockOffset). When each run ends, the other two
// shards hold no row: every call went to the tenant's shard.
func TestShardedConformance(t *testing.T) {
	for shard := range pgtest.Shards {
		t.Run(fmt.Sprint("shard", shard), func(t *testing.T) {
			storetest.Run(t, func(t *testing.T) storetest.Harness {
				pools := pgtest.ShardPools(t)
				var shifted atomic.Int64
				shards := make([]*postgres.Store, len(pools))
				rs := make([]replica, len(pools))
				for i, pool := range pools {
					if err := postgres.Migrate(context.Background(), pool); err != nil {
						t.Fatalf("Migrate: %v", err)
					}
					shards[i] = newStore(t, pool)
					rs[i] = replica{pool, shards[i]}
					postgres.SetClockOffset(shards[i], func() time.Duration { return time.Duration(shifted.Load()) })
					listen(t, shards[i])
				}
				st, err := pgshard.New(shards, pgshard.WithTenants(map[string]int{storetestTenant: shard}))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { // before the schemas are dropped
					for i, r := range rs {
						if n := r.count(t, "true"); i != shard && n != 0 {
							t.Errorf("shard %d holds %d rows of a tenant routed to shard %d", i, n, shard)
						}
					}
				})
				advance := func(t *testing.T, d time.Duration) {
					for _, r := range rs {
						r.advance(t, d)
					}
					shifted.Add(int64(d))
				}
				return storetest.Harness{Store: st, Advance: advance, ShiftsRecords: true}
			})
		})
	}
}
