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
//     of that slot (see "Data loss"). Only hashes of the scope are stored,
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
// # Configuring the server
//
// New refuses a server whose maxmemory-policy is not noeviction: every other
// policy may evict a live record, and its key would run a second time. It
// reads the policy from INFO memory, on every node of a cluster, so managed
// services that disable CONFIG are checked too; one that answers INFO
// without the field is refused with a message that says so. A policy
// changed later fails the store (see "Data loss"). With
// noeviction, a full server refuses writes: Reserve and Complete fail with
// store.ErrFull while replays go on working; unlike store/memory, a short
// outcome after a refused one is not promised room.
//
// Durability is the server's. With appendonly no, a restart loses every
// record written since the last RDB snapshot, or all of them with save "";
// appendonly yes with appendfsync everysec loses up to a second of records
// in a crash of the host, and appendfsync always none, at the cost of an
// fsync per write. A record lost so is a key that would run again: the
// store sees a restart that lost every record, and one that lost the last
// ones if this process wrote among them (see "Data loss").
//
// # Replicas and failover
//
// Replication is asynchronous: a primary that fails before its replica has
// a record loses it, and the replica that takes over would run its key
// again. A store that wrote what the replica lacks notices by its write
// counters and fails closed (see "Data loss"): no key runs twice, but every
// call is refused until the processes restart. WithReplicas(n) closes that
// window: Reserve (when it acquires) and
// Complete send WAIT n after their script, on the same connection, and
// report success only once n replicas hold the write. When fewer confirm
// within the store's timeout, Reserve frees the key and fails, and Complete
// fails (the interceptor tries it again in the background, which waits
// again) with store.ErrUnavailable. So with n equal to the replicas a
// primary has, one replica down stops all first calls: choose n below the
// number of replicas to stay available through one failure. Measured costs
// are in BENCHMARKS.md; the failover test in tests/redis counts what a
// killed primary loses with and without the wait.
//
// # Data loss
//
// A record that Redis loses is a key that would run again in silence: its
// absence looks like a new key. The store notices when Redis loses its data
// set, may evict, or goes back to a state older than one this store saw, and
// then fails closed: every operation returns an error that wraps
// store.ErrDataLost and names the cause and the fix, which the interceptor
// answers with Unavailable (IDEMPOTENCY_STORE_UNAVAILABLE, the handler not
// run) and logs at Error; the store logs it at Error too (when it first sees
// it, then once a minute at most while it refuses).
//
// Markers. New writes, where there is none, a marker key that never
// expires: <prefix>:epoch on one server; on a cluster one in every hash
// slot, <prefix>:epoch:{n} with n the least number that hashes to the slot
// (16,384 small keys), each beside the records of its slot. A marker holds an epoch (a time and a random number), and each
// store keeps what New read. A script that finds no record (Reserve about to
// acquire; Complete or Release about to answer that the lease is lost; Find
// about to answer nothing) first reads the marker of the record's slot, and
// fails if it is gone or holds another epoch. A record that is there needs
// no marker, so replays read nothing more; a first call reads one key more,
// inside its script (and the write counter, below). Seen so, by the first operation on a lost slot that
// misses a record:
//
//   - FLUSHDB or FLUSHALL;
//   - a server restarted without its data (no persistence);
//   - a failover to an empty replica: a Sentinel-managed server, or a primary
//     of a cluster (then the first operation on one of its slots);
//   - eviction of a marker, its deletion by hand, or its expiry;
//   - the markers of a store started after the loss: it writes new epochs,
//     so the stores of processes started before it fail on their first
//     operation on those slots, even if none of them missed a record first.
//
// Write counters. Beside each marker, in its slot, is a counter that never
// expires, <prefix>:writes (<prefix>:writes:{n} on a cluster). The script of
// every Reserve that acquires and every Complete that records raises it
// (INCR) and returns its value with its reply; each Store keeps, per slot,
// the highest value it has seen: read in New, then returned by its own
// writes once they succeeded (with WithReplicas, once the replicas
// confirmed them). Other processes' writes only raise the counter, so a
// store sharing the server with others sees no decrease from them. Before a
// script writes a record, and where it looks at the marker, it checks that
// the counter is not below the highest value this store saw; below, the
// server has gone back to an older state that lacks writes this store saw
// acknowledged, and the store fails closed as for a flush (for every key,
// replays of records that survived included, until the process restarts).
// A counter that is gone although the store saw it is such a loss too.
// This costs a write one GET, one PTTL and one INCR more inside its
// script, a miss one GET and one PTTL more (and the marker's PTTL), a
// replay nothing, and New one GET more per slot. Seen so, by this store's first write on a slot gone
// back, or its first call there that finds no record:
//
//   - a restart from an RDB snapshot or AOF file that lacks a write on the
//     slot made before this store's New or its last acknowledged write
//     there;
//   - a failover to a replica that lacks such a write (WithReplicas makes
//     acknowledged writes reach the replicas first);
//   - the counter deleted by hand, or expired.
//
// Expiries. The markers and counters never expire, and the store sees to it:
// a script that reads a marker or counter refuses one that has an expiry
// (an operator's EXPIRE, or a SET with EX), which would end the store's sight
// of a loss once it fired. The error wraps store.ErrDataLost and names the
// key; nothing is lost yet, so the store refuses only while the expiry is
// there: new keys fail (and the recording of calls running), recorded keys
// replay, and once the expiry is removed (PERSIST) the store serves again
// by itself. An expiry that fired first is a loss, as above.
//
// Release does not raise the counter: a release lost leaves a key in
// progress until its lease ends, and never runs it twice. A script that
// sees the counter behind writes nothing, not even the counter, so that it
// does not raise the counter back towards what another process saw.
//
// Servers. New also notes each server's evicted_keys (INFO stats). Then the
// first operation after each check interval (WithCheckInterval, 1s by
// default) reads every primary's INFO memory, stats and server again, in one
// round trip to each, in parallel, before its own work; operations in the
// meantime do not wait. It finds:
//
//   - a maxmemory-policy other than noeviction: every operation fails, naming
//     the policy and the fix, until a check finds noeviction on every primary
//     again and no key evicted: the store then serves again by itself;
//   - evicted_keys risen on a primary: the store fails for good (Redis does
//     not say which keys it evicted, the store's or another program's).
//
// What it does not see, or sees late:
//
//   - Evictions and a policy change are seen within one check interval: an
//     operation that starts less than the interval after the last check does
//     not check, and may run a key whose record was evicted since. Keys evicted
//     and then, before the next check, the server restarted with its data or
//     its counters reset (CONFIG RESETSTAT) are not seen at all.
//   - A loss before a store starts: its New cannot tell a lost data set from
//     a new one, so it writes the missing markers and runs the lost keys
//     again (on a cluster, if only some slots lost their markers, it logs so
//     at Warn). The stores that ran before the loss fail, as above.
//   - A partial loss (the markers stay: a restart from an RDB or AOF file
//     that misses the last writes, a failover to a replica that lags) is
//     seen only by a store that saw a lost slot's counter higher than the
//     loss left it: one whose New, or one of whose acknowledged writes on the
//     slot, came after a write the server lost. Not by a store started after
//     the loss, nor by one whose New and last acknowledged write on the slot
//     both came before every lost write: a restore to a snapshot taken after
//     this process last wrote there loses only other processes' writes, or
//     this process's writes whose calls failed (a reply lost to a timeout,
//     replicas that did not confirm in time). So a lone process misses only
//     the loss of writes whose calls returned an error; with several, those
//     that wrote after the snapshot notice, each on its own next write or
//     miss on a lost slot, and the others serve on.
//   - Seen late: until its next write or miss on a lost slot, a store that
//     will notice answers from what the server holds, which is right for the
//     records that survived: a completed record replays, and one whose
//     outcome was lost answers in progress until its lease ends, when the
//     takeover is the write that notices.
//   - Not seen at all if, before that next write or miss, writes of stores
//     that do not notice (started after the loss, or not past the slot's
//     old state, as above) raise its counter back to what the store saw: on
//     a cluster, where each slot counts on its own and one process may
//     seldom touch a slot, more likely than on one server. Nor is a lost
//     record that no counter reflects: one deleted by hand, a lost Release
//     (harmless: see Release).
//   - A failover within moments of the New that wrote a marker, before the
//     replica has it, fails the store closed although nothing was lost; so
//     does one within moments of the New that read a counter the replica
//     had not yet received, although only writes that were never confirmed
//     (with WithReplicas, failed calls) may have been lost.
//
// What an operator does. For a policy: set maxmemory-policy noeviction, with
// CONFIG SET and in redis.conf (or the managed service's parameters); the
// stores serve again within a check interval, if nothing was evicted. For
// an expiry on a marker or counter: remove it (PERSIST with the key the
// error names), and stop whatever set it (a script or tool that gives every
// key a TTL); the stores serve again at once. For a loss (flush, empty or
// lagging failover, restore of an older snapshot, evictions, a marker or
// counter that expired or was deleted): fix its cause, then restart the
// processes. A new Store accepts the loss: keys recorded before it run
// again if they are retried. Until then every call with a key is answered
// Unavailable; with engine.WithFailOpen, handlers run unprotected
// instead, as for any store failure. A prefix taken out of use leaves its
// markers and counters behind: delete them with its records.
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
