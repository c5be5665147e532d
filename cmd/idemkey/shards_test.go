package main

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
)

// A store sharded by tenant (store/pgshard) is migrated shard by shard:
// migrate up on each shard's URL prepares it, and the sharded store then
// starts (each shard's schema check passes) and records a tenant's key on
// its shard, which stats on that shard's URL counts, and no other's.
func TestMigrateShards(t *testing.T) {
	urls := pgtest.ShardURLs(t)
	shards := make([]*postgres.Store, len(urls))
	for i, url := range urls {
		mustRun(t, exitOK, url, "migrate", "up")
		pool, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		if shards[i], err = postgres.New(pool); err != nil {
			t.Fatalf("shard %d after migrate up: %v", i, err)
		}
	}
	st, err := pgshard.New(shards)
	if err != nil {
		t.Fatal(err)
	}
	r := store.Reservation{Key: store.ScopeKey("acme", createCharge, "k"), Fingerprint: store.Fingerprint{1},
		Lease: time.Minute, Retention: time.Hour, Partition: store.TenantPartition("acme")}
	if res, err := st.Reserve(context.Background(), r); err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve: %v, %v; want acquired", res.State, err)
	}
	home := st.ShardOf("acme")
	for i, url := range urls {
		var s struct {
			InProgress int64 `json:"in_progress"`
		}
		jsonOf(t, exitOK, url, &s, "stats")
		want := int64(0)
		if i == home {
			want = 1
		}
		if s.InProgress != want {
			t.Errorf("stats on shard %d: %d in progress, want %d (acme's shard is %d)", i, s.InProgress, want, home)
		}
	}
}
