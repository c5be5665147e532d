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
//     script touches one slot: the record's, and the marker and write counter
//     of that slot (docs/redis.md). Only hashes of the scope are stored,
//     never a raw key or tenant; errors and logs carry neither.
//   - It is a store.Watcher: a duplicate that waits for a running call
//     (engine.WithInProgressWait) is told when any process records or
//     releases the key, by pub/sub from the scripts of Complete and Release
//     of a record that a Reserve found in progress, and reads it then
//     rather than at its next poll. New subscribes on a connection of its
//     own, and a goroutine hears the channel until the client is closed, or
//     Store.Close (for a store dropped while its client lives on; a server
//     that refuses the channel leaves a store that polls); see watch.go for what happens when the subscription drops, and why a
//     cluster's message is not sharded.
//   - The store is not store.Atomic: handlers run two-phase.
//
// # Configuring the server, replicas and lost data
//
// New refuses a server whose maxmemory-policy is not noeviction (read from
// INFO memory, on every node of a cluster): any other policy may evict a
// live record, and its key would run a second time. A full server refuses
// writes: Reserve and Complete fail with store.ErrFull while replays go on.
// Durability is the server's (appendonly, appendfsync), and replication is
// asynchronous: WithReplicas(n) makes Reserve and Complete wait until n
// replicas hold their write (WAIT n), so that a failover loses no
// acknowledged record.
//
// The store notices when Redis loses its data set (a flush, a restart
// without persistence, a failover to an empty replica), may evict, or goes
// back to an older state than one this store saw: by a marker key and a
// write counter in every slot, which never expire, and by each server's
// INFO, read again every WithCheckInterval. It then fails closed: every
// operation returns an error that wraps store.ErrDataLost and names the
// cause and the fix, answered Unavailable without running the handler. Some
// losses it sees late or not at all; docs/redis.md in the repository says
// which, what each check costs, and what an operator does, with the
// server's configuration and failover in full.
//
// # Timeouts
//
// WithTimeout bounds each operation, five seconds by default. Complete and
// Release ignore the caller's cancellation, so that a client that hangs up
// does not leave its key in progress. go-redis retries a command after a
// connection error; the scripts are safe to run again: a repeated Complete
// of the same token and outcome answers success, and a repeated Reserve
// finds its own reservation in progress.
//
// Valkey speaks the same protocol and scripting, but only Redis 7 has been
// tested here.
package redis
