package redis_test

import (
	"context"
	"log"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/redis"
)

// A server on Redis: New checks at start-up that the server never evicts a
// record (maxmemory-policy noeviction) and reads the store's markers; the
// engine on the store then serves every entry point. It needs a Redis
// server, so it is compiled but not run: tests/redis runs the store's tests.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := goredis.NewClient(&goredis.Options{Addr: "redis.internal:6379"})
	defer client.Close() // ends the store's subscription too
	st, err := redis.New(ctx, client, redis.WithReplicas(1), redis.WithTimeout(2*time.Second))
	if err != nil {
		log.Fatal(err) // a policy that may evict a record is refused here
	}

	// tenantOf reads the caller's tenant from the identity that the
	// authentication middleware verified.
	eng, err := engine.New(st, engine.WithTenant(tenantOf))
	if err != nil {
		log.Fatal(err)
	}
	_ = eng // then interceptor.UnaryServerInterceptor(eng), idemhttp.Middleware(eng), ...
}

func tenantOf(ctx context.Context) (string, error) { return "acme", nil }
