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
// # Schema
//
// One row per key scope, keyed by the 32-byte SHA-256 that the interceptor
// computes (package store's Key): raw keys and tenant ids never reach the
// database. A row holds the request's fingerprint, its state (in_progress or
// completed), the fencing token of its holder, the end of the holder's lease,
// the encoded outcome, its creation and expiry times, and whether a
// duplicate waits for it (see "Duplicates of a running call"). Tokens come
// from a sequence, so no token is handed out twice, even to a key deleted
// and reserved again.
//
// Migrations holds the numbered .up.sql and .down.sql files for a migration
// tool of your own; Migrate applies them for those without one. WithTable puts
// the table under another name or schema; pass the same option to Migrate and
// New.
//
// # Schema versions
//
// Migrate records each migration it applies in the table
// "<table>_migrations"; the newest one applied is the table's schema version.
// New checks it once, in one query bounded by WithTimeout, so that a
// forgotten migration fails the start-up rather than the first call:
//
//   - no table: New fails, naming the fix: run `idemkey migrate up
//     -database-url URL` (with -table for another table) or call Migrate;
//   - a migration of this idemkey not applied (a table migrated by an older
//     idemkey, or reverted by MigrateDown): New fails the same way, naming the
//     table's schema version and the one this idemkey needs;
//   - migrations this idemkey does not know, applied by a newer idemkey: New
//     accepts the table and logs a warning naming both versions. Refusing it
//     would stop an older replica from restarting during a rolling upgrade,
//     and a rollback from starting at all; every migration keeps the release
//     before it working (docs/versioning.md), so the older release runs on
//     the schema of the next one. Nothing checks how far ahead the schema is:
//     two releases ahead is not promised to work;
//   - no "<table>_migrations" (the table was made by a migration tool of your
//     own, from Migrations), or no right to read it: New checks only that the
//     table exists, and keeping it migrated is up to that tool.
//
// A database that cannot be reached is tried again until the timeout, then New
// fails with an error that matches store.ErrUnavailable and says the schema
// could not be checked: a server started while its database is down does not
// come up, and its supervisor restarts it. WithoutSchemaCheck builds the store
// without querying, for a server that must start without its database.
// New's errors never hold the database URL.
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
// # Duplicates of a running call
//
// A duplicate that finds its key in progress waits for the first call
// (engine.WithInProgressWait), reading the key again at growing intervals:
// 25 ms, then twice as long each time, up to 500 ms. The Store is a
// store.Watcher, so that the duplicate reads it the moment the first call
// records or releases its key instead, at no more reads, while Listen runs:
//
//	go st.Listen(ctx)
//
// Listen listens on the table's notification channel (named by the
// table's OID, "idemkey:<oid>:changed") on a connection of its own, which
// it takes out of the pool for good (pgxpool's Hijack: set up as the pool's
// are, hooks and all), so that the database sees one connection more than
// the pool's MaxConns. How each mode is told:
//
//   - Two-phase: the first duplicate of a run to find the record in
//     progress marks it waited (the column of migration 002, in one more
//     statement), and the Complete or Release of a marked record notifies
//     the channel in its own statement, which PostgreSQL delivers as it
//     commits. The row's lock orders the mark and the write, so no
//     duplicate told "in progress" misses the notification. A record no
//     duplicate waited for sends none: a notification costs the commit that
//     sends it a lock that orders such commits (PostgreSQL's notification
//     queue), which new keys must not pay.
//   - Atomic: a running call writes no row to mark. The first duplicate of a
//     run that a process finds held asks, with the ROLLBACK of its Begin
//     (in the round trip it makes anyway), and the holder's process, which
//     hears the question on its own Listen, sends the notification with its
//     COMMIT, in the same pipeline. A holder whose COMMIT went out before
//     the question reached it (within about a round trip of the
//     duplicate's Begin) answers it when it comes, with a notification of
//     its own once the COMMIT has returned. A holder that does not listen
//     notifies nothing: the duplicate has its answer at its first poll,
//     25 ms after it began to wait.
//
// Measured (BenchmarkDuplicateAnswered, two replicas on one database): a
// duplicate had its answer 0.2 to 0.7 ms after the first call's record in
// both modes, against 23 to 26 ms polled, with the same two reads.
//
// Run Listen on every replica: one that does not listen neither marks nor
// asks, and its duplicates poll, as before; a holder that does not listen
// does not answer an atomic question. While Listen's connection is down
// the notifications are lost: duplicates poll, and once it listens again
// every key watched is read at once. Listen is of no use behind a pooler in
// transaction mode, which does not keep a session's LISTEN: there, leave
// it out, and duplicates poll.
//
// # Atomic mode
//
// The Store implements store.Atomic, so the interceptor can run a method in
// atomic mode (interceptor.WithAtomic): Begin starts a transaction on a
// connection of the pool and takes the key in it, the handler writes in the
// same transaction, and the record commits with its writes. A handler
// finds the transaction with TxFromContext, a Querier with pgx's query
// methods (it fits sqlc's DBTX) and no Commit or Rollback:
//
//	func (s *Service) CreateCharge(ctx context.Context, req *pb.CreateChargeRequest) (*pb.Charge, error) {
//		tx, ok := postgres.TxFromContext(ctx)
//		if !ok { // with WithKeyRequired, only a server bug gets here
//			return nil, status.Error(codes.Internal, "not in atomic mode")
//		}
//		_, err := tx.Exec(ctx, `INSERT INTO charges ...`, ...)
//		...
//	}
//
// How it holds a key. A running atomic call writes no row until it
// commits: it holds the key's transaction-level advisory lock instead (the
// one-bigint form: the first 8 bytes of the key's hash XOR the table's OID,
// so that two stores' tables never share a lock), and writes the
// completed record once, with COMMIT. This is one write per key, the least
// a record can cost (BENCHMARKS.md measures it against the designs before
// it). Begin tries the lock without waiting, then reads the key's record:
// a live record answers the call, and otherwise the call runs if it took
// the lock, and hears "in progress" if another call holds it. The lock space is
// shared with the application's own advisory locks of that form on the same
// database: a lock of the application's that happens to take the same
// bigint as a running key's makes a call with that key hear "in progress"
// while both are held (the two-int form, pg_advisory_lock(int, int), is
// another space, and never conflicts).
//
// The read runs in the statement after the lock's, with a snapshot taken
// once the lock is tried, so it sees the record of a call that held the
// lock and committed just before (PostgreSQL makes a commit visible before
// it lets its locks go): under READ COMMITTED no handler runs for a key
// that was just recorded. Under REPEATABLE READ or SERIALIZABLE the
// transaction keeps its first statement's snapshot; such a call then finds
// out when its own record fails on the key (the primary key, or for a
// takeover the row's newest version): nothing of it commits, and Commit
// returns store.ErrLeaseLost, for which the interceptor reads the record
// and answers the replay. Its handler has run once for nothing, and been
// rolled back. A two-phase reservation of the same key (a method moved
// between modes during a rolling deploy) is settled the same way, under any
// isolation.
//
// What to know:
//   - A call costs two round trips besides the handler's own statements, and
//     one commit: BEGIN, the lock, the read and a savepoint go out as one
//     pipeline, and the record and COMMIT as another. A replay costs two round trips
//     and commits nothing, but is answered after the first: its transaction
//     wrote and locked nothing, so a goroutine of the store rolls it back and
//     returns the connection after the reply. On a connection that has not
//     prepared these statements yet, preparing them costs another round
//     trip.
//   - A recorded error rolls back to the savepoint, undoing the handler's
//     writes, even after a statement of the handler failed, and commits the
//     record alone. A success after a failed statement cannot commit: the
//     caller gets Unavailable, and the key is free.
//   - A duplicate of a running call waits on nothing: Begin finds the
//     key's lock taken and answers "in progress" at once (the
//     interceptor then asks again while engine.WithInProgressWait
//     lasts, and answers the replay once the first call has committed:
//     at once while Listen runs, see "Duplicates of a running call").
//     Nothing in Begin sets a lock timeout, so a wait of the database's own
//     (extending the table's file, a migration's lock) delays a call but
//     never turns a new key into "in progress".
//   - A duplicate of a running call is told the instant its key expires,
//     the one the first call's reply and every replay tell: the running
//     call's record is not written yet, but it will expire at the start of
//     the call's transaction (its now()) plus the retention, however long
//     the handler runs. Begin reads that start, pg_stat_activity's
//     xact_start of the session that holds the key's lock in pg_locks, in
//     one more statement, sent only for a key found held (a statement that
//     reads pg_locks costs even where it is never run). Where the start
//     cannot be read, the duplicate is told no expiry (a zero
//     store.Entry.Expires), never a wrong one: the store's role may not
//     see the holder's session (pg_stat_activity shows another role's
//     sessions only to a role with pg_read_all_stats; replicas that log in
//     as one role see each other's), or the holder ended, or let the lock
//     go, before the read. Behind pgbouncer the holder is the server
//     connection, which pg_stat_activity shows all the same.
//   - Each running call holds one connection of the pool until it ends. At
//     most WithAtomicConns calls run at once (three quarters of the pool's
//     MaxConns by default). When all run, Begin decides the next call all
//     the same, in its transaction on one of the connections left free: a
//     replay, or a duplicate of a running call, is answered at once, without
//     waiting for a transaction slot, and only a new key waits for one,
//     within the store's timeout, in its transaction, holding the key's
//     lock. Only when the calls that wait so would leave the pool no
//     connection free but one does Begin run a probe on its own instead,
//     and a new key waits for a slot without a connection: so no call pays
//     the probe's round trip while a connection is free, and a flood of new
//     keys or duplicates never takes the capacity that replays need. The
//     probe tries the key's lock in share mode, which only a running call's
//     lock conflicts with: two probes of one key never find each other "in
//     progress", and a duplicate that reads when the key's running call
//     started (above) never reads a probe's instead. Size the pool for the atomic calls to run at once plus a
//     quarter (pgxpool's default, max(4, cores), runs three). A handler
//     that also takes another connection from the same pool needs a pool
//     larger than that.
//   - The transaction has the database's default isolation. Under REPEATABLE
//     READ or SERIALIZABLE, a record that fails to serialize is taken as a
//     lost race (above); a COMMIT that fails to serialize rolls back
//     everything, and the caller gets Unavailable, so its retry runs again. A handler that
//     sees a serialization failure or a deadlock (SQLSTATE 40001, 40P01)
//     should answer a released code such as Aborted, not a recorded one.
//   - Deferred constraints are checked at COMMIT, after the handler has
//     returned: a violation there rolls everything back and answers
//     Unavailable, on every retry. Check them in the handler (SET CONSTRAINTS
//     ALL IMMEDIATE) to answer a recorded error instead.
//   - The transaction is the handler's until it returns: it must not commit or
//     roll back itself. If it does, the caller gets Unavailable; a COMMIT run
//     with the Querier's Exec is recorded after the fact, as in two-phase
//     mode, so that a retry replays, but a transaction ended any other way
//     records nothing, and a retry runs the handler again. The Querier fails
//     once the call has ended.
//   - ContextWithTx puts a transaction of your own where TxFromContext finds
//     it, to run a handler outside gRPC (a test, a batch job) in a
//     transaction.
//
// # Batches of atomic calls
//
// The Store implements store.BatchAtomic too, for a message consumer that
// takes its messages in batches (consumer.Consumer.ProcessBatch): BeginBatch
// decides a batch of keys in one transaction, each as Begin decides one, and
// the batch's handlers then write in that transaction, one after another,
// each call's writes apart from the others'. What it costs, and why:
//
//   - One round trip decides the whole batch: BEGIN and one probe over
//     arrays of the keys (probeSQL over unnest, with a lateral index lookup
//     per key, which no plan turns into a scan of the table) go out as one
//     pipeline, and the advisory lock of every free key is taken in it. A
//     batch of n calls whose handlers write one row each costs n+2 round
//     trips and one commit, where n calls one at a time cost 3n round trips
//     and n commits (TestBatchRoundTrips).
//   - Each call's writes are kept apart by a savepoint of its own
//     (SAVEPOINT idemkey_call_<i>), which goes out in one pipeline with the
//     handler's first statement: keeping a call's writes costs no round
//     trip of its own, and a call that sends nothing sends no savepoint.
//     The savepoint of a call whose writes are kept is not released: the
//     next call's nests in it, and COMMIT releases them all, a statement
//     less per call (2 to 14% of a batch's time, measured against
//     releasing each). Undoing a call's writes (a released call, or a
//     recorded error) costs one round trip: ROLLBACK TO its savepoint,
//     which keeps the calls' before it. Each call's savepoint has its own
//     name, so that one that was never set cannot be confused with another
//     call's: returning to it fails, and the batch with it, rather than
//     undo the call before.
//   - The records go out with COMMIT, in one multi-row INSERT (and one
//     guarded upsert per key taken over). A record that another call wrote
//     since the probe (one that committed between the probe's snapshot and
//     its lock, or a two-phase reservation) fails the whole commit:
//     store.ErrLeaseLost, nothing of the batch commits, and the consumer
//     processes its messages again one at a time, their handlers a second
//     time, after first runs that were rolled back. This is rare: it takes
//     a race on one key of the batch.
//   - Each call that writes takes a subtransaction. PostgreSQL keeps up to
//     64 of a transaction's in shared memory; past that, every other
//     session's snapshot must look them up in pg_subtrans, which slows the
//     whole database, so the engine decides at most engine.MaxBatch (64)
//     calls in one batch.
//   - A batch holds one connection, and one WithAtomicConns slot, for its
//     whole run, and the key of every call it acquired until it commits: a
//     duplicate of any is "in progress" meanwhile, and is told the expiry
//     of the key's record, from the batch's start, as a duplicate of a
//     call of Begin's is (one read for all of a batch's keys found held,
//     on another connection of the pool). When every slot is taken,
//     BeginBatch waits for one as Begin does: in its transaction on a free
//     connection, or, with none to lend, after the probe run on its own,
//     only if it acquires a key.
//   - A failure that ends the transaction ends the batch, with nothing
//     committed, and the consumer decides each of its calls again on its
//     own: the connection lost; a handler that commits or rolls back itself
//     (a COMMIT of the handler's is followed by the records of the calls
//     whose writes it committed, as in Begin's transaction); with pgx's
//     statement cache (the default), a statement that fails to parse or
//     plan (a missing table, say), which pgx prepares before the pipeline
//     that carries its call's savepoint, so that no savepoint is set; and a
//     statement whose arguments pgx cannot encode after its call's
//     savepoint was queued, for which pgx closes the connection. In pgx's
//     exec and simple modes (behind pgbouncer) a statement that fails to
//     parse is undone alone, as any statement that fails when it runs is.
//
// # Batches of two-phase calls
//
// The Store implements store.BatchReserver too: ReserveBatch reserves a
// batch of keys in one statement, an INSERT ... ON CONFLICT DO NOTHING of
// every key whose rows that were not inserted answer from their records,
// as Reserve's first statement does for one key. A record to take over, or
// one committed by another call while the statement ran, is decided with
// Reserve, one more round trip each. The statement inserts the keys in
// their byte order, so that two batches that share keys wait for each
// other's rows in one order and never deadlock (the conformance suite's
// ConcurrentReserveBatch deadlocks without it).
//   - The handler's Querier is Begin's, with one difference: QueryRow
//     sends its statement when the row is scanned, when a savepoint is to
//     go with it. CopyFrom, and a statement with one of pgx's options (a
//     QueryExecMode, a QueryRewriter) as its first argument, send a pending
//     savepoint on its own first, a round trip more.
//
// # Lost connections
//
// A pooled connection can die under a statement: a terminated session, a
// database restart, a failover, a pooler restart. Complete and Release are
// fenced by the token, so they run again on a fresh connection, with short
// pauses, until the store's timeout; a retry whose first attempt may have
// taken effect unseen checks for its own effect rather than report a lost
// lease. Reserve, Find and Begin run again at once on another connection, a
// few times, while the database can be reached; when no new connection can
// be made they fail at once, and the client's retry policy waits instead.
//
// # Failover to a standby
//
// With a primary and a standby that takes over, give the pool both, and let
// only the writable one serve: a multi-host URL with
// target_session_attrs=read-write (New warns without it, since a connection
// to a standby fails every write), and connect_timeout, so that a primary
// that no longer answers costs each new connection that long, not the
// call's whole deadline:
//
//	postgres://app@pg-a:5432,pg-b:5432/payments?target_session_attrs=read-write&connect_timeout=2
//
// When the primary dies, the pool's connections to it fail. While no server
// takes writes, reservations and reads answer Unavailable at once, and
// records and releases are retried on fresh connections (by the store within
// its timeout, then by the interceptor until shortly before the lease ends),
// so a record is not lost to a failover that completes sooner. The servers
// recover without a restart once the standby is promoted.
//
// What an acknowledged commit survives is the standby's to decide. With a
// synchronous standby (synchronous_standby_names naming it, and
// synchronous_commit on or remote_apply), every commit the primary
// acknowledged is on the standby: TestFailover (package reliability) kills
// the primary under load and promotes the standby, and finds no recorded reply
// lost and no call run twice in atomic mode. With an asynchronous standby,
// commits the standby had not received when the primary died are gone: in
// atomic mode the record and the handler's writes go together, so a retry
// runs the handler once more, on a database that no longer holds the first
// run's writes, and answers differently from the first reply; in two-phase
// mode a lost record makes a retry run the handler again, beside the first
// run's effects elsewhere. A lost reservation can also lose the token
// sequence's latest values, so the new primary may hand out a fencing token
// again. RELIABILITY.md has the counts.
//
// # Behind a connection pooler
//
// pgbouncer in transaction pooling mode gives each transaction whichever
// server connection is free and, before version 1.21, keeps no prepared
// statements. Behind it, set pgx's mode for such poolers in the URL:
// default_query_exec_mode=exec (or simple_protocol). The store, Migrate and
// atomic mode then work as they do directly, because the store keeps no
// session state: its advisory locks are transaction-level, released when
// the transaction ends, and it prepares or creates nothing that outlives a
// transaction (Listen, which does, is of no use there: see "Duplicates of a
// running call"). An atomic call's transaction stays on one pgx
// connection, so on one server connection, until it ends. In exec mode the
// server parses and plans every statement: a first call costs about a third
// more, a replay about twice as much (BENCHMARKS.md).
//
// With pgx's default statement cache, statements fail as soon as pgbouncer
// runs one connection's prepared statement on another server connection; the
// store's and Migrate's errors then name the setting. A session setting made
// with SET after connecting does not reach later transactions, and pgbouncer
// refuses most settings in the URL: set them on the database or role (ALTER
// ROLE ... SET) instead. Tested with pgbouncer 1.18 (TestPgbouncer).
//
// # Tracing its statements
//
// The store runs its statements on the pool it is given, so a pgx tracer set
// on the pool's configuration (ConnConfig.Tracer, for instance otelpgx's)
// sees them, each in the span of the call that made it.
//
// # Errors
//
// The Store's methods translate every driver error in one place. A database
// that cannot be reached, is shutting down or failing over, is overloaded,
// or does not answer within the timeout gives store.ErrUnavailable; when the
// context ended (the caller's or the store's own timeout), the error also
// matches context.Canceled or context.DeadlineExceeded. Other server errors
// (a permission, a failed login) keep their SQLSTATE and message; a missing
// table or sequence of the store's also says that it is gone and how to make
// it. Either way the interceptor fails closed with Unavailable, without
// running the handler. No pgx error value or connection detail reaches a
// caller; WithLogger logs the driver's own error at Debug, a server's without
// its detail, which may quote a row's values. Migrate, an
// administrative call, returns the driver's errors wrapped.
//
// # Data loss
//
// What the store detects of its table's data going away while it serves:
//
//   - a dropped table (or sequence): detected. Every call fails closed with
//     Unavailable, without running its handler, and the interceptor's Error
//     log holds the store's error, which says that the table is gone and how
//     to make it again (SQLSTATE 42P01); a restarted server's New refuses to
//     start, saying the same;
//   - a truncated table, or deleted rows: not detected. An empty table looks
//     like one that never held those keys, and no cheap check tells them
//     apart: the keys recorded in the lost rows count as new, and their
//     retries run the handler again. The defence is the database's: backups
//     to restore from, and permissions, so that no role but the migrating one
//     may TRUNCATE the table, and none but the store's may DELETE from it.
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
