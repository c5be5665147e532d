// Package redis is an idemkey store on Redis (or Valkey): one server, a
// primary with replicas, or a Redis Cluster, through go-redis v9.
//
// The package is named redis, like its directory beside store/memory and
// store/postgres; a program that also imports go-redis names one of the two,
// usually go-redis:
//
//	import (
//		goredis "github.com/redis/go-redis/v9"
//		"github.com/idemkey/idemkey/store/redis"
//	)
//
//	client := goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:6379"})
//	st, err := redis.New(ctx, client, redis.WithReplicas(1))
//	if err != nil { ... }
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//	if err != nil { ... }
//	idem, err := interceptor.UnaryServerInterceptor(eng)
//	if err != nil { ... }
//	srv := grpc.NewServer(grpc.UnaryInterceptor(idem))
//
// # Guarantees
//
//   - Reserve, Complete and Release are each one Lua script, atomic on the
//     server, in one round trip; Find is one read-only script. Concurrent
//     calls' scripts share writes, through the client's AutoPipeline
//     (pipe.go), unless the client has ContextTimeoutEnabled.
//   - Leases and expiry follow the Redis server's clock (TIME), never the Go
//     process's. Expiry is native (PEXPIREAT): nothing needs sweeping, so
//     the store is no store.Sweeper.
//   - A fencing token never repeats for a key (see reserveScript).
//   - Cluster-safe: every script touches one slot (docs/redis.md). Only
//     hashes of the scope are stored, never a raw key or tenant.
//   - It is a store.Watcher: a waiting duplicate is told by pub/sub when the
//     key is recorded or released (watch.go). Store.Close ends the
//     subscription of a store dropped while its client lives on.
//   - It is a store.Stepper and a store.Renewer, each method one fenced
//     script: a key's steps are one hash in its record's slot that outlives
//     Release and expires natively with the record (steps.go, scripts.go).
//   - The store is not store.Atomic: handlers run two-phase.
//
// # The server and lost data
//
// New refuses a server whose maxmemory-policy is not noeviction: eviction
// would run a live record's key a second time. A full server answers
// store.ErrFull to new keys while replays go on. WithReplicas(n) makes
// writes wait for n replicas (WAIT n), so that a failover loses no
// acknowledged record. When Redis loses data (a flush, a restart without
// persistence, a failover to an empty or older replica, an eviction), the
// store fails closed with errors that wrap store.ErrDataLost. docs/redis.md
// says what each check sees and costs, what it misses, and what an operator
// does.
//
// # Timeouts
//
// WithTimeout bounds each operation, five seconds by default. Complete and
// Release ignore the caller's cancellation. The scripts are safe for
// go-redis to run again after a connection error, alone or in a pipeline
// sent again whole: a repeated Complete answers success, and a repeated
// Reserve finds its own reservation.
//
// Only Redis 7 has been tested here, and steps need it (PEXPIRETIME);
// Valkey speaks the same protocol.
package redis
