// Package spanner is an idemkey store on Cloud Spanner, two-phase and
// atomic: in atomic mode the handler writes through the call's Spanner
// read-write transaction, and the key's record commits with its writes.
//
// The package is named spanner, like its directory; a program that also
// imports the Spanner client names one of the two:
//
//	import (
//		"cloud.google.com/go/spanner"
//		idemspanner "github.com/idemkey/idemkey/store/spanner"
//	)
//
//	db := "projects/P/instances/I/databases/D"
//	if err := idemspanner.Migrate(ctx, adminClient, db); err != nil { ... }
//	client, err := spanner.NewClient(ctx, db)
//	if err != nil { ... }
//	st, err := idemspanner.New(client)
//	if err != nil { ... }
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//
// and in a handler of an atomic method (interceptor.WithAtomicMethods):
//
//	txn, ok := idemspanner.TxFromContext(ctx)
//	_, err := txn.Update(ctx, spanner.Statement{SQL: "INSERT INTO charges ..."})
//
// Migrate creates the tables (Spanner DDL, also in Migrations for a tool of
// your own; WithTable names them). Records, Forget, Steps, Stats,
// MigrationStatus and MigrateDown are an operator's, as store/postgres's
// of the same names: the idemkey command's -spanner.
//
// # Guarantees
//
//   - Every decision is one read-write transaction, serializable: a read of
//     the key's row with Spanner's own clock (CURRENT_TIMESTAMP()), and the
//     commit that carries the write, if any, as a buffered mutation: two
//     round trips, the fewest a conditional write takes on Spanner. Find and
//     Lookup are one strong single-use read each. Spanner retries a
//     transaction it aborts; nothing else runs twice.
//   - Leases and expiry are on Spanner's clock, never the Go process's.
//   - The fencing token is the reservation's commit timestamp (whole
//     microseconds, times 1000, plus the key's place in its batch): Spanner
//     gives transactions that write one row distinct commit timestamps, so
//     a token never repeats for a key, even after its row was deleted.
//   - Expiry: the table's row deletion policy (Spanner's TTL) deletes a row
//     some time after its expiry, or its lease's end if later; until then
//     the store counts an expired row absent itself. Nothing needs
//     sweeping, so the store is no store.Sweeper.
//   - It is a store.Finder, store.BatchReserver (one transaction for the
//     batch, at most 1000 keys), store.Stepper, store.Renewer and
//     store.Looker, and store.Atomic. It is no store.Watcher: a duplicate
//     polls.
//   - A Spanner cell holds at most 10 MiB: an outcome larger than that (an
//     engine.WithMaxRecordSize above it) is store.ErrFull, and the engine
//     records its stand-in rather than answer a success no record backs.
//   - Only hashes of the scope are stored, never a raw key or tenant; errors
//     carry Spanner's status code, not its message, which may quote a row.
//
// # Atomic mode
//
// Begin reserves the key as Reserve does, in a transaction of its own, so
// that a duplicate is told "in progress" at once; the handler's transaction
// (a spanner.ReadWriteStmtBasedTransaction, which TxFromContext returns)
// begins with its first statement, and Commit reads the reservation in it
// (still this run's, else store.ErrLeaseLost) and commits the record with
// the handler's writes. A recorded error (keepWrites false) rolls the
// handler's writes back and records as Complete does: Spanner has no
// savepoints. A run that dies commits nothing of its own; its reservation
// stays in progress until its lease ends, as in two-phase mode, and then
// one retry runs.
//
// Spanner aborts a read-write transaction when another wins a lock it
// needs. The handler's transaction is not run again by the store: its
// function is the handler, and the engine cannot call it twice. A commit
// that aborts commits nothing, releases the reservation and returns
// store.ErrUnavailable, which the client sees as a store unavailable, and
// its retry runs the handler once more in a new transaction. So a handler
// in atomic mode does only transaction writes: a call to another system
// (a card processor, a broker) before an aborted commit has happened once
// already when the retry makes it again. Such effects belong in two-phase
// methods, with engine.Step. A handler returns Spanner's errors as they
// are: their code (Aborted) is one the engine releases.
//
// # Caveats
//
// The store is tested on the Cloud Spanner emulator only (make test starts
// one: scripts/with-spanner), never on Spanner itself; its tests are in
// tests/spanner, whose module may require what a user's never does. The emulator shows
// no real latency and no replication, and it serialises transactions: the
// Go client runs every transaction on one multiplexed session, and the
// emulator allows one read-write transaction at a time on a session,
// ending the older one when a newer begins (its statements then fail with
// NotFound "Transaction not found" or FailedPrecondition, not ABORTED).
// The store therefore runs its own read-write transactions one at a time
// when SPANNER_EMULATOR_HOST is set, and runs again one the emulator
// ended; concurrent transactions, lock waits and Spanner's own aborts are
// not what the tests see. An atomic call's transaction cannot be run
// again, and any other read-write transaction ends it there, the store's
// own too: on the emulator an atomic handler that records a step
// (engine.Step) after its first read or write never commits, and is
// answered unavailable at every retry. Record steps before the first
// statement, as the example does. docs/stores.md has the details.
//
// The emulator accepts the row deletion policy; the tests do not wait for
// its deletions (on Spanner, within days of a row's expiry), and check the
// store's own expiry check.
package spanner
