package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// The built server on three PostgreSQL databases (-shard-database-urls), in
// atomic mode and two-phase: each tenant's charges are on one shard, the
// shard that holds their keys' records (a record per charge there); a retry
// replays, and a second process on the same shards replays too.
func TestShardedServer(t *testing.T) {
	bin := servertest.Build(t)
	for _, atomic := range []bool{true, false} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			urls := pgtest.ShardURLs(t)
			args := []string{"-database-url=", "-shard-database-urls", strings.Join(urls, ","), fmt.Sprint("-atomic=", atomic)}
			a, b := servertest.Start(t, bin, args...), servertest.Start(t, bin, args...)
			const perTenant = 5
			for _, apiKey := range []string{"sk_test_acme", "sk_test_globex"} {
				for i := range perTenant {
					key := idemkey.NewKey()
					req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: int64(100 + i), Currency: "EUR"}
					first, _, err := createAs(a, apiKey, key, req)
					if err != nil {
						t.Fatalf("CreateCharge: %v", err)
					}
					again, trailer, err := createAs(b, apiKey, key, req)
					if err != nil || !proto.Equal(first, again) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
						t.Fatalf("retry on the other process: %v, %v (replayed %v); want the first's reply, replayed", again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
					}
				}
			}
			homes := map[string][]int{} // tenant -> the shards holding its charges
			for i, u := range urls {
				pool, err := pgxpool.New(context.Background(), u)
				if err != nil {
					t.Fatal(err)
				}
				defer pool.Close()
				charges, records := count(t, pool, "charges"), count(t, pool, "idempotency_keys")
				if charges != records {
					t.Errorf("shard %d holds %d charges and %d records, want a record per charge", i, charges, records)
				}
				for _, tenant := range []string{"acme", "globex"} {
					var n int
					if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM charges WHERE tenant = $1`, tenant).Scan(&n); err != nil {
						t.Fatal(err)
					}
					if n > 0 {
						homes[tenant] = append(homes[tenant], i)
						if n != perTenant {
							t.Errorf("shard %d holds %d of %s's charges, want all %d", i, n, tenant, perTenant)
						}
					}
				}
			}
			for _, tenant := range []string{"acme", "globex"} {
				if len(homes[tenant]) != 1 {
					t.Errorf("%s's charges are on shards %v, want one", tenant, homes[tenant])
				}
			}
		})
	}
}
