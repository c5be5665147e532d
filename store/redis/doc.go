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
//	srv := grpc.NewServer(grpc.UnaryInterceptor(interceptor.UnaryServerInterceptor(st)))
//
// # Guarantees
//
//   - Reserve, Complete and Release are each one Lua script (EVALSHA, EVAL
//     when the server does not know it yet): one round trip, atomic on the
//     server. Find is one read-only script.
//   - Leases and expiry follow the Redis server's clock (TIME inside the
//     scripts), never the Go process's: servers with skewed clocks agree.
//   - Expiry is native (PEXPIREAT): Redis deletes each record once its
//     retention and lease have passed. Nothing needs sweeping, so the store
//     does not implement store.Sweeper, and a store.Janitor given it stops.
//   - A fencing token never repeats for a key: it is the server's time in
//     microseconds, or one more than the key's last token, which a released
//     record keeps until its expiry (see reserveScript).
//   - Cluster-safe: a record is one hash named prefix:{sha256 hex}, so every
//     script touches one key in one slot. Only hashes of the scope are
//     stored, never a raw key or tenant; errors and logs carry neither.
//   - The store is not store.Atomic: handlers run two-phase.
//
// # Configuring the server
//
// New refuses a server whose maxmemory-policy is not noeviction: every other
// policy may evict a live record, and its key would run a second time. It
// reads the policy from INFO memory, on every node of a cluster, so managed
// services that disable CONFIG are checked too; one that answers INFO
// without the field is refused with a message that says so. With
// noeviction, a full server refuses writes: Reserve and Complete fail with
// store.ErrFull while replays go on working; unlike store/memory, a short
// outcome after a refused one is not promised room.
//
// Durability is the server's. With appendonly no, a restart loses every
// record written since the last RDB snapshot, or all of them with save "";
// appendonly yes with appendfsync everysec loses up to a second of records
// in a crash of the host, and appendfsync always none, at the cost of an
// fsync per write. A record lost so is a key that runs again.
//
// # Replicas and failover
//
// Replication is asynchronous: a primary that fails before its replica has
// a record loses it, and the replica that takes over runs its key again.
// WithReplicas(n) closes that window: Reserve (when it acquires) and
// Complete send WAIT n after their script, on the same connection, and
// report success only once n replicas hold the write. When fewer confirm
// within the store's timeout, Reserve frees the key and fails, and Complete
// fails (the interceptor tries it again in the background, which waits
// again) with store.ErrUnavailable. So with n equal to the replicas a
// primary has, one replica down stops all first calls: choose n below the
// number of replicas to stay available through one failure. Measured costs
// are in BENCHMARKS.md; the failover test in this package counts what a
// killed primary loses with and without the wait.
//
// # Timeouts
//
// WithTimeout bounds each operation, DefaultTimeout by default. Complete and
// Release ignore the caller's cancellation, so that a client that hangs up
// does not leave its key in progress. go-redis retries a command after a
// connection error; the scripts are safe to run again: a repeated Complete
// of the same token and outcome answers success, and a repeated Reserve
// finds its own reservation in progress.
//
// Valkey speaks the same protocol and scripting, but only Redis 7 has been
// tested here.
package redis
