// Package pgshard is an idemkey store over several PostgreSQL databases,
// sharded by tenant: each tenant's records live on one shard, a
// store/postgres store of its own, so that an atomic call commits its
// record with the tenant's business data in the shard's transaction.
//
//	shards := []*postgres.Store{st0, st1, st2} // each on its own database, migrated
//	st, err := pgshard.New(shards, pgshard.WithTenants(map[string]int{"big-customer": 2}))
//	...
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//	...
//	go (&store.Janitor{Store: st}).Run(ctx) // sweeps every shard
//	go st.Listen(ctx)                       // every shard's Listen
//
// # Routing
//
// The store never sees a tenant, only its store.Partition, an 8-byte hash
// (store.TenantPartition). Reserve, Begin and the batches route by each
// Reservation's Partition; the methods that take only a Key (Complete,
// Release, Find, Lookup, Renew, the steps) by the partition the engine puts
// in each store call's context (store.ContextWithPartition). A call whose
// context carries none is a programming error, refused, never sent to a
// default shard.
//
// A tenant of WithTenants goes to the shard named; every other one to
// Lamping and Veach's jump consistent hash of its partition over the
// shards. Adding a shard at the end of the list moves about 1/n of the
// hashed tenants, each to the new shard, and no other; removing or
// reordering shards moves most of them. A tenant that the hash would move
// can be pinned where it is with WithTenants first. ShardOf tells a
// tenant's shard, for the application's own reads of its business data.
//
// # What is per shard
//
// Sweep and Listen run on every shard; Watch asks every shard (only the
// key's can hold it). Stats, Records, Forget, the migrations and the outbox
// relay are each shard's (Shards): run `idemkey migrate up` and a relay on
// each shard's database. idemkey.shard.duration times each call by its
// shard (WithMeterProvider), where the engine's metrics see one store.
//
// # Batches
//
// A batch (ReserveBatch, BeginBatch) is split by shard, each shard's part
// one round trip of its own, the shards at once. An atomic batch across
// shards is one transaction per shard, committed one after another: a
// crash or a failure between two commits leaves the shards committed
// before it committed, each message with its record, and the rest rolled
// back, so that a redelivery replays the first and runs the others, each
// still exactly once. The calls of a tenant being moved (WithMoving), or
// of a shard that fails, fail alone (a store.PartialError): the engine
// answers those as a store that is down, and runs the batch's other calls,
// those of the tenants on healthy shards, as it would without them.
//
// # Moving a tenant
//
// WithMoving refuses a tenant's new calls with ErrMoving (answered as a
// store that is down, and redelivered by brokers) while its records move:
// a call is never split across two shards. docs/stores.md has the steps.
package pgshard
