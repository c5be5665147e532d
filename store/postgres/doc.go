// Package postgres is an idemkey store on a PostgreSQL table, through pgx/v5.
// Several server processes on one database behave as one service: a duplicate
// sent to one replica while another runs the first call is told "in
// progress", and recorded replies survive restarts.
//
//	pool, err := pgxpool.New(ctx, databaseURL)
//	...
//	if err := postgres.Migrate(ctx, pool); err != nil { ... }
//	st, err := postgres.New(pool)
//	...
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//	...
//	idem, err := interceptor.UnaryServerInterceptor(eng, interceptor.WithAtomic())
//	...
//	srv := grpc.NewServer(grpc.UnaryInterceptor(idem))
//	go (&store.Janitor{Store: st, Interval: time.Minute}).Run(ctx)
//	go st.Listen(ctx) // a duplicate of a running call is answered at once
//
// Migrate before New: New fails at start-up, naming the command to run, if
// the table lacks a migration of this release (a newer release's are
// accepted, for rolling upgrades). Migrations holds the .sql files for a
// tool of your own; WithTable names the table (give it to Migrate and New
// alike). Rows are keyed by a SHA-256 of the key's scope: raw keys and
// tenant ids never reach the database.
//
// # Guarantees
//
//   - Reserve is one statement, in the common cases one round trip: the
//     primary key settles races, and a replay locks no row and writes
//     nothing (it still needs a primary, not a standby). A statement that
//     loses a race to a concurrent release or sweep, or a serialization
//     failure under a stricter default isolation, runs again, up to 10 times.
//   - Every decision about time uses the database's now(), never the
//     application server's clock, so replicas with skewed clocks agree.
//   - Complete and Release succeed only for the token that holds an unexpired
//     in-progress row; otherwise store.ErrLeaseLost. They run detached from
//     the caller's cancellation, bounded by WithTimeout (5 s by default).
//   - Recorded steps (store.Stepper) live in "<table>_steps", each method
//     one statement whose fence, with a token, is Complete's test of the
//     record, read FOR SHARE in the statement that writes; they are written
//     through the pool, outside an atomic call's transaction, so a rollback
//     keeps them. Renew (store.Renewer) moves a held lease's end. FinishStep,
//     ForgetSteps and Renew run detached and retried like Complete.
//   - Lookup (store.Looker) reads a key's record and its finished steps in
//     one statement that writes nothing; a key that a running atomic call
//     holds has no record yet, and is told in progress from its advisory
//     lock, tried in share mode without waiting (lookup.go).
//   - The outbox (store.Outbox, package outbox) lives in "<table>_outbox":
//     WriteMessages writes through the transaction its context carries;
//     a relay's claims (FOR UPDATE SKIP LOCKED, a lease per row) and marks
//     are one statement each on the pool.
//   - Sweep deletes expired rows, and expired steps, in short batches,
//     skipping rows a reservation has locked, resting between batches as
//     WithSweepShare paces it. Run it with store.Janitor; nothing starts a
//     goroutine on its own.
//
// # Duplicates and atomic mode
//
// Run Listen on every replica (not behind a pooler in transaction mode): a
// duplicate of a running call is then answered within a millisecond of the
// first call's record, rather than at its next poll.
//
// The Store implements store.Atomic (and store.BatchAtomic): in an entry
// point's atomic mode (interceptor.WithAtomic, say) the handler's writes,
// through TxFromContext, and the key's record commit in one transaction. A
// running call holds its key with an advisory lock, not a row, so a key
// costs one write, and a crash rolls everything back. Each running call
// holds a pool connection (at most WithAtomicConns). The handler must not
// commit or roll back the transaction itself.
//
// docs/postgres.md in the repository has the schema and its versions, how
// duplicates are told, atomic mode in full (isolation, the pool's size,
// deferred constraints, the advisory lock space), batches, lost connections,
// failover, pgbouncer, tracing, the errors and the data loss detected;
// docs/stores.md compares the stores.
//
// # Caveats
//
//   - pgx closes a connection whose context is cancelled mid-statement, so a
//     reservation cut short by its caller has an unknown outcome: the key may
//     stay in progress until its lease ends.
//   - The table must stay logged and synchronous_commit on: an UNLOGGED table
//     or synchronous_commit = off loses recorded replies when the database
//     crashes, and a lost reply means a retry runs the handler again.
//   - Partition the table, if at all, by hash of the key: a unique key on a
//     table partitioned by time cannot settle races across partitions.
package postgres
