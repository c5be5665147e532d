package example_test

import (
	"context"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
)

// shardedEngine is docs/stores.md's pgshard snippet, between the markers
// (TestREADMESnippets): an engine on three shards, each a migrated store on
// its own database.
func shardedEngine(ctx context.Context, st0, st1, st2 *postgres.Store, tenantOf engine.TenantFunc) (*engine.Engine, error) {
	// readme:pgshard
	st, err := pgshard.New([]*postgres.Store{st0, st1, st2},
		pgshard.WithTenants(map[string]int{"big-customer": 2})) // the rest by the hash
	if err != nil {
		return nil, err
	}
	eng, err := engine.New(st, engine.WithTenant(tenantOf))
	go st.Listen(ctx)                       // every shard's
	go (&store.Janitor{Store: st}).Run(ctx) // sweeps every shard
	// end readme
	return eng, err
}

var _ = shardedEngine
