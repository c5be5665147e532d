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
// Migrate before New: New checks once that the table has every migration
// of this release and fails at start-up, naming the command to run, if not
// (migrations of a newer release are accepted with a warning, for rolling
// upgrades). Migrations holds the numbered .up.sql and .down.sql files for
// a migration tool of your own; WithTable puts the table under another name
// or schema (pass it to Migrate and New alike). Rows are keyed by a SHA-256
// of the key's scope: raw keys and tenant ids never reach the database.
//
// # Guarantees
//
//   - Reserve is one statement and, in the common cases, one round trip. The
//     primary key settles races; there is no read-then-write. A replay locks
//     no row and writes nothing, so it costs no WAL flush (as a statement
//     that may insert, it still takes the table's ROW EXCLUSIVE lock, and
//     needs a primary, not a read-only standby). When a row changes between
//     the statement's snapshot and its insert (a concurrent release or
//     sweep), Reserve runs the statement again, up to 10 times.
//   - The statements expect READ COMMITTED, PostgreSQL's default isolation.
//     Under a default of REPEATABLE READ or SERIALIZABLE, a statement that
//     loses a race fails with a serialization failure; the store runs it
//     again, up to 10 times.
//   - Every decision about time (lease ends, expiry) uses the database's
//     now(), never the application server's clock, so replicas with skewed
//     clocks agree.
//   - Complete and Release succeed only for the token that holds an unexpired
//     in-progress row; otherwise store.ErrLeaseLost. They run detached from
//     the caller's cancellation, bounded by WithTimeout (5 s by default), so a
//     client that hangs up cannot leave its key in progress.
//   - Sweep deletes expired rows in batches, one short statement each, and
//     skips rows a reservation has locked: it never waits on live traffic.
//     Run it periodically with store.Janitor; nothing starts a goroutine on
//     its own.
//
// # Duplicates and Listen
//
// A duplicate of a running call polls the key (25 ms, doubling to 500 ms)
// for up to engine.WithInProgressWait. Run Listen on every replica: it
// listens on a connection of its own, taken out of the pool for good, and
// a duplicate is answered within a millisecond of the first call's record,
// in both modes. Behind a pooler in transaction mode, leave it out.
//
// # Atomic mode
//
// The Store implements store.Atomic (and store.BatchAtomic for a
// consumer's batches): with interceptor.WithAtomic or WithAtomicMethods,
// the handler's writes and the key's record commit in one transaction,
// which the handler finds with TxFromContext (a Querier with pgx's query
// methods, which fits sqlc's DBTX). A running call holds its key with a
// transaction-level advisory lock, not a row, so a key costs one write,
// sent with COMMIT, and a crash rolls everything back. A call costs two
// round trips and one commit besides its handler's statements, and holds
// a pool connection while it runs (at most WithAtomicConns at once). A
// recorded error rolls the handler's writes back to a savepoint and
// commits the record alone. The handler must not commit or roll back the
// transaction itself.
//
// # Where the details are
//
// docs/postgres.md in the repository has the schema and its versions, how
// duplicates are told in each mode, atomic mode in full (isolation levels,
// the pool's size, deferred constraints, the advisory lock space), batches
// of atomic and two-phase calls, lost connections, failover to a standby,
// pgbouncer, tracing, the errors and what lost data the store detects;
// docs/stores.md compares the stores, and BENCHMARKS.md and RELIABILITY.md
// measure them.
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
