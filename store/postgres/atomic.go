package postgres

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

// Querier is what a handler in atomic mode reads and writes through: the
// call's transaction. Its methods are pgx's, so it fits sqlc's DBTX and most
// query helpers, and a *pgxpool.Pool or pgx.Tx is one too. The transaction
// itself has no Commit or Rollback: the interceptor ends it together with the
// record. Like a pgx connection, it is for one goroutine at a time, and it
// fails once the handler has returned.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

type txKey struct{}

// TxFromContext returns the transaction of the atomic call that ctx belongs
// to; ok is false outside one (a method in two-phase mode, or a call without
// an idempotency key). A handler that must work both ways falls back to its
// pool.
func TxFromContext(ctx context.Context) (tx Querier, ok bool) {
	tx, ok = ctx.Value(txKey{}).(Querier)
	return tx, ok
}

// ContextWithTx returns ctx carrying tx, for TxFromContext: the interceptor
// uses it in atomic mode, and code that calls a handler outside gRPC (a test,
// a batch job) can use it to run the handler in a transaction of its own.
func ContextWithTx(ctx context.Context, tx Querier) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// savepoint separates the handler's writes from the rest of the
// transaction, so that a recorded error can undo them and still commit the
// record.
const savepoint = "idemkey_handler"

// Kinds of answer of probeSQL.
const (
	probeFree      = 1 // no live record, and the key's lock is taken
	probeCompleted = 2 // a completed record
	probeHeld      = 3 // an in-progress record (two-phase) under a live lease
	probeBusy      = 4 // no live record, and another transaction holds the key's lock
	probeTakeable  = 5 // a record that may be taken over, and the key's lock is taken
)

// probeSQL decides, in one statement that writes nothing, what an atomic
// call with key $1 and fingerprint $2 does. It reads the key's record and,
// only when there is none or it may be taken over, tries the key's advisory
// lock ($3, see lockID) without waiting: the lock is what a running atomic
// call holds instead of a row, until its transaction ends. Begin runs it on
// its own (autocommit) when every transaction slot is taken, to ask
// whether the key is free, and lets the lock go at once; a batch runs it
// over arrays in its transaction (batchProbeSQL), which keeps the locks.
//
// Result columns: kind, then the record's fingerprint, outcome and time left
// on its lease (NULL without a record), and the expiry of the key's record
// once recorded by this transaction (recordExpires, with the retention $4).
func probeSQL(table string) string {
	return fmt.Sprintf(`
SELECT CASE
		WHEN c.key IS NULL THEN CASE WHEN %[8]s THEN %[3]d ELSE %[4]d END
		WHEN %[2]s THEN CASE WHEN %[8]s THEN %[5]d ELSE %[4]d END
		WHEN c.state = 'completed' THEN %[6]d
		ELSE %[7]d END,
	c.fingerprint, c.outcome, c.lease_end - now(), %[9]s
FROM (VALUES (1)) AS one (x) LEFT JOIN %[1]s AS c ON c.key = $1`,
		table, takeable("c"), probeFree, probeBusy, probeTakeable, probeCompleted, probeHeld, tryLock("$3", table),
		recordExpires("c", takeable("c"), "$4"))
}

// recordExpires is the SQL of when the record of the key whose row is r (a
// NULL row without one) expires, once the transaction records it: the
// row's own expiry if it lives on, else now() plus the retention in
// microseconds, as recordSQL and takeoverSQL write it. The transaction's
// now() is its start, so every statement of it tells the same instant.
func recordExpires(r, takeable, retention string) string {
	return fmt.Sprintf(`CASE WHEN %[1]s.key IS NULL OR ((%[2]s) AND %[1]s.expires_at <= now())
		THEN now() + %[3]s * interval '1 microsecond' ELSE %[1]s.expires_at END`, r, takeable, retention)
}

// lockSQL tries the key's advisory lock ($1, see lockID) without waiting:
// the lock is what a running atomic call holds instead of a row, until its
// transaction ends. It answers too when a record the transaction writes
// expires, with the retention $2 (recordExpires).
func lockSQL(table string) string {
	return "SELECT " + tryLock("$1", table) + ", now() + $2 * interval '1 microsecond'"
}

// tryLock is the SQL that tries, without waiting, the advisory lock of the
// key whose lockID the expression id holds, on table: XORed with the
// table's OID, so that two stores' tables never share a key's lock.
func tryLock(id, table string) string {
	return fmt.Sprintf(`pg_try_advisory_xact_lock(%s # '%s'::regclass::oid::bigint)`, id, table)
}

// readSQL reads the key's record, in the statement after lockSQL's, so with
// a snapshot taken once the lock is tried: a call that held the lock and
// committed its record just before is seen, because PostgreSQL makes a
// commit visible before it lets the transaction's locks go. Under READ
// COMMITTED, the default, a call that takes the lock therefore never runs
// its handler for a key that was just recorded; under REPEATABLE READ or
// SERIALIZABLE the transaction keeps the snapshot of its first statement,
// and the record's failure at commit settles it instead.
//
// Result columns: completed, fingerprint, outcome, time left on the lease,
// takeable, and the record's expiry once this transaction records it, with
// the retention $3 (recordExpires); no row without a record.
func readSQL(table string) string {
	return fmt.Sprintf(`SELECT c.state = 'completed', c.fingerprint, c.outcome, c.lease_end - now(), %[2]s, %[3]s
FROM %[1]s AS c WHERE c.key = $1`, table, takeable("c"), recordExpires("c", takeable("c"), "$3"))
}

// recordSQL inserts the completed record of an atomic call whose probe found
// no record ($1 key, $2 fingerprint, $3 outcome, $4 retention in
// microseconds). A record inserted since (by a call that lost no race of its
// own, or by a two-phase reservation) makes it fail with a unique violation.
// Atomic records take no fencing token of the sequence: nothing fences them,
// and 0 is never a two-phase holder's.
const recordSQL = `INSERT INTO %s (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
VALUES ($1, $2, 'completed', 0, now(), now(), now() + $4 * interval '1 microsecond', $3)`

// takeoverSQL records like recordSQL over a record that the probe found
// takeable. ON CONFLICT tests the newest version of the row, and the
// statement fails (dividing by the count of rows written) when that is no
// longer takeable, as recordSQL fails on a conflict.
func takeoverSQL(table string) string {
	return fmt.Sprintf(`WITH w AS (
	INSERT INTO %[1]s AS r (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
	VALUES ($1, $2, 'completed', 0, now(), now(), now() + $4 * interval '1 microsecond', $3)
	ON CONFLICT (key) DO UPDATE SET
		fingerprint = excluded.fingerprint,
		state = 'completed',
		token = 0,
		lease_end = excluded.lease_end,
		outcome = excluded.outcome,
		created_at = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
		expires_at = CASE WHEN r.expires_at <= now() THEN excluded.expires_at ELSE r.expires_at END
	WHERE %[2]s
	RETURNING 1
) SELECT 1 / count(*) FROM w`, table, takeable("r"))
}

// retention is r's retention in microseconds, as the SQL takes it.
func retention(r store.Reservation) int64 { return max(r.Retention, 0).Microseconds() }

// lockID is the advisory lock of key: its first 8 bytes, a bigint, which
// tryLock XORs with the table's OID, so that stores on two tables of one
// database (two services, or a test's schemas) never share a key's lock. The
// one-bigint form of PostgreSQL's advisory locks is shared with whatever
// locks of that form the application takes on the same database; the two-int
// form is another space, and never conflicts with it.
func lockID(key store.Key) int64 { return int64(binary.BigEndian.Uint64(key[:8])) }

var _ store.Atomic = (*Store)(nil)

// Begin implements store.Atomic in one round trip once the connection has
// prepared the statements: BEGIN, the key's lock tried without waiting
// (lockSQL), its record read (readSQL) and a savepoint go out as one
// pipeline. Nothing in it waits: a running atomic call holds the key's
// advisory lock, and its record is written only when it commits, so a
// duplicate is answered "in progress" at once, and a replay from the
// record. A call that is not acquired wrote nothing and holds no lock that
// matters, so its ROLLBACK goes out in a goroutine that the caller does not
// wait for (it frees the connection, and the transaction's slot, when
// done).
//
// At most WithAtomicConns transactions are open at once. When all are taken
// by running handlers, Begin first runs the probe (probeSQL) on its own, on
// a connection the transactions leave free: a replay, or a duplicate of a
// running call, is answered from it at once, and only a key that is free
// waits for a transaction to end.
func (s *Store) Begin(ctx context.Context, r store.Reservation) (store.Result, store.Tx, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if !s.takeSlot() {
		res, err := s.probe(ctx, r)
		if err != nil || res.State != store.Acquired {
			return res, nil, err
		}
		select {
		case s.slots <- struct{}{}:
		case <-ctx.Done():
			return store.Result{}, nil, s.translate(ctx, "begin", ctx.Err())
		}
	}
	res, tx, ending, err := s.begin(ctx, r)
	if tx == nil && !ending {
		s.freeSlot()
	}
	return res, tx, err
}

// takeSlot takes one of the transactions' slots if one is free; freeSlot
// gives it back once the transaction's connection is back in the pool.
func (s *Store) takeSlot() bool {
	select {
	case s.slots <- struct{}{}:
		return true
	default:
		return false
	}
}

func (s *Store) freeSlot() { <-s.slots }

// probe runs probeSQL for r on its own (autocommit), running it again on a
// fresh connection if its own died (reconnect).
func (s *Store) probe(ctx context.Context, r store.Reservation) (store.Result, error) {
	var (
		res store.Result
		err error
	)
	for range maxAttempts {
		res, _, err = scanProbe(s.pool.QueryRow(ctx, s.probeSQL, r.Key[:], r.Fingerprint[:], lockID(r.Key), retention(r)), r)
		if !reconnect(err) {
			break
		}
	}
	if err != nil {
		return store.Result{}, s.translate(ctx, "begin", err)
	}
	return res, nil
}

// scanProbe reads the row of probeSQL for r.
func scanProbe(row pgx.Row, r store.Reservation) (res store.Result, takeover bool, err error) {
	var (
		kind        int
		fingerprint []byte
		leaseLeft   pgtype.Interval
	)
	if err := row.Scan(&kind, &fingerprint, &res.Outcome, &leaseLeft, &res.Expires); err != nil {
		return store.Result{}, false, err
	}
	switch kind {
	case probeFree, probeTakeable:
		return store.Result{State: store.Acquired, Expires: res.Expires}, kind == probeTakeable, nil
	case probeBusy:
		// The running call's record is not written yet: its fingerprint
		// cannot be read, and its lease is unknown.
		return store.Result{State: store.InProgress, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}, false, nil
	case probeCompleted:
		res.State = store.Completed
	default:
		res.State, res.RetryAfter = store.InProgress, intervalDuration(leaseLeft)
	}
	copy(res.Fingerprint[:], fingerprint)
	return res, false, nil
}

// keyRecord is the row of readSQL.
type keyRecord struct {
	completed, takeable bool
	fingerprint         []byte
	outcome             []byte
	leaseLeft           pgtype.Interval
	expires             time.Time // as recorded by the transaction (recordExpires)
}

// scan reads the row of readSQL; found is false without a record.
func (c *keyRecord) scan(row pgx.Row) (found bool, err error) {
	err = row.Scan(&c.completed, &c.fingerprint, &c.outcome, &c.leaseLeft, &c.takeable, &c.expires)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// decide is Begin's answer for r, given whether it took the key's lock and
// the key's record, if found: a live record answers the call; otherwise
// the lock's holder runs it (takeover reports a record to take over), and
// without the lock another call does: "in progress", with r's own
// fingerprint, since the running call's record is not written yet, and a
// lease and expiry unknown. expires is lockSQL's: when a new record of the
// transaction's expires.
func (c *keyRecord) decide(r store.Reservation, locked, found bool, expires time.Time) (res store.Result, takeover bool) {
	switch {
	case found && !c.takeable && c.completed:
		res = store.Result{State: store.Completed, Outcome: c.outcome, Expires: c.expires}
		copy(res.Fingerprint[:], c.fingerprint)
		return res, false
	case found && !c.takeable:
		res = store.Result{State: store.InProgress, RetryAfter: intervalDuration(c.leaseLeft), Expires: c.expires}
		copy(res.Fingerprint[:], c.fingerprint)
		return res, false
	case locked && found:
		return store.Result{State: store.Acquired, Expires: c.expires}, true
	case locked:
		return store.Result{State: store.Acquired, Expires: expires}, false
	}
	return store.Result{State: store.InProgress, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}, false
}

// begin is Begin once it holds a slot. A connection that is lost takes the
// transaction with it, so Begin starts again on another. ending reports that
// a goroutine is ending the transaction and frees the slot itself.
func (s *Store) begin(ctx context.Context, r store.Reservation) (res store.Result, tx store.Tx, ending bool, err error) {
	for range maxAttempts {
		conn, err := s.pool.Acquire(ctx)
		if err != nil {
			return store.Result{}, nil, false, s.translate(ctx, "begin", err)
		}
		var (
			locked, found bool
			expires       time.Time
			rec           keyRecord
			scanErr       error
		)
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		// The scans' errors are kept apart, because pgx forgets the prepared
		// statements of a batch that fails, and no row is no failure of theirs.
		b.Queue(s.lockSQL, lockID(r.Key), retention(r)).QueryRow(func(row pgx.Row) error { scanErr = row.Scan(&locked, &expires); return nil })
		b.Queue(s.readSQL, r.Key[:], r.Fingerprint[:], retention(r)).QueryRow(func(row pgx.Row) error {
			var err error
			found, err = rec.scan(row)
			scanErr = cmp.Or(scanErr, err)
			return nil
		})
		b.Queue("SAVEPOINT " + savepoint)
		err = conn.SendBatch(ctx, b).Close()
		if err == nil {
			err = scanErr
		}
		res, takeover := rec.decide(r, locked, found, expires)
		switch {
		case err == nil && res.State == store.Acquired:
			return res, &atomicTx{store: s, conn: conn, r: r, takeover: takeover}, false, nil
		case err == nil:
			// The call wrote nothing, and a lock it took matters to no
			// one (the key's record answers every other call): the answer
			// need not wait for the ROLLBACK's round trip.
			go func() {
				s.rollback(ctx, conn)
				s.freeSlot()
			}()
			return res, nil, true, nil
		case serializationFailure(err):
			// The ROLLBACK goes on its own, because pgx prepares anew the
			// statements of a batch that failed, which PostgreSQL refuses
			// inside a failed transaction.
			if err := s.rollback(ctx, conn); err != nil {
				return store.Result{}, nil, false, err
			}
		case reconnect(err):
			conn.Release() // the pool closes it; the transaction died with it
		default:
			s.rollback(ctx, conn)
			return store.Result{}, nil, false, s.translate(ctx, "begin", err)
		}
	}
	return store.Result{}, nil, false, fmt.Errorf("idemkey postgres: begin: %w: the connection died, or the transaction failed to serialize, in %d attempts in a row", store.ErrUnavailable, maxAttempts)
}

// rollback ends conn's transaction, if any, and returns conn to the pool. A
// connection that cannot roll back is closed by the pool, which makes the
// database roll back.
func (s *Store) rollback(ctx context.Context, conn *pgxpool.Conn) error {
	defer conn.Release()
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		return s.translate(ctx, "rollback", err)
	}
	return nil
}

// atomicTx is the store.Tx of Begin: the connection in the transaction, and
// the reservation it decided.
type atomicTx struct {
	store    *Store
	conn     *pgxpool.Conn // nil once the transaction has ended
	handler  *handlerTx    // the handler's view of it, once it has one
	r        store.Reservation
	takeover bool // the probe found a record to take over
}

var (
	errTxEnded    = errors.New("idemkey postgres: the transaction has already ended")
	errRolledBack = errors.New("the transaction had failed, so COMMIT rolled it back")
)

// HandlerContext implements store.Tx: TxFromContext finds the transaction in
// the context it returns.
func (t *atomicTx) HandlerContext(ctx context.Context) context.Context {
	if t.handler == nil {
		t.handler = &handlerTx{conn: t.conn.Conn()}
	}
	return ContextWithTx(ctx, t.handler)
}

// end takes the connection for ending the transaction, and cuts the
// handler's view of it off.
func (t *atomicTx) end() *pgxpool.Conn {
	conn := t.conn
	t.conn = nil
	if t.handler != nil {
		t.handler.ended.Store(true)
	}
	return conn
}

// Commit implements store.Tx in one round trip, the record and COMMIT going
// out as one pipeline; without keepWrites, the return to the savepoint costs
// another. A record that another call wrote since Begin (one that committed
// between the probe's snapshot and its lock, or a two-phase reservation)
// makes the record fail, and nothing commits: ErrLeaseLost.
func (t *atomicTx) Commit(ctx context.Context, outcome []byte, keepWrites bool) error {
	conn := t.end()
	if conn == nil {
		return errTxEnded
	}
	defer t.store.freeSlot()
	if outcome == nil {
		outcome = []byte{} // pgx sends a nil slice as NULL, which means "in progress"
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	switch conn.Conn().PgConn().TxStatus() {
	case 'I':
		return t.handlerEnded(ctx, conn, outcome)
	case 'E':
		if keepWrites {
			t.store.rollback(ctx, conn)
			return errors.New("idemkey postgres: commit: a statement of the handler failed, so its transaction cannot commit, yet the handler succeeded")
		}
	}
	if !keepWrites {
		// On its own, not in the batch below: pgx may have to prepare the
		// batch's statements, which PostgreSQL refuses in a transaction that
		// a failed statement of the handler left aborted.
		if _, err := conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepoint); err != nil {
			t.store.rollback(ctx, conn)
			return t.store.translate(ctx, "commit", err)
		}
	}
	sql, args := t.record(outcome)
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, recordErr := br.Exec()
	tag, commitErr := br.Exec()
	err := cmp.Or(recordErr, commitErr, br.Close())
	if err == nil && tag.String() != "COMMIT" {
		err = errRolledBack
	}
	if err == nil {
		conn.Release()
		return nil
	}
	t.store.rollback(ctx, conn)
	if recordErr != nil && lostRecord(recordErr) {
		return fmt.Errorf("idemkey postgres: commit: %w: another call recorded the key first, so nothing of this one was committed", store.ErrLeaseLost)
	}
	if errors.Is(err, errRolledBack) {
		return fmt.Errorf("idemkey postgres: commit: %w", err)
	}
	return t.store.translate(ctx, "commit", err)
}

// record is the statement that writes the completed record of outcome, and
// its arguments: an insert, or for a record Begin found takeable, the
// guarded takeover.
func (t *atomicTx) record(outcome []byte) (sql string, args []any) {
	sql = t.store.recordSQL
	if t.takeover {
		sql = t.store.takeoverSQL
	}
	return sql, []any{t.r.Key[:], t.r.Fingerprint[:], outcome, retention(t.r)}
}

// lostRecord reports whether the record's statement failed because another
// call wrote the key's record after Begin's probe: a unique violation, the
// division by zero of takeoverSQL, or, under REPEATABLE READ or
// SERIALIZABLE, a serialization failure on the row.
func lostRecord(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch pgErr.Code {
	case "23505", "22012", "40001":
		return true
	}
	return false
}

// handlerEnded records outcome after a handler ended the transaction itself,
// and reports the bug. If a COMMIT of the handler's ended it, its writes are
// in, and the record is written after them, as in two-phase mode, so that a
// retry replays; if it rolled back, or it cannot be told how it ended,
// nothing is recorded, and a retry runs the handler again.
func (t *atomicTx) handlerEnded(ctx context.Context, conn *pgxpool.Conn, outcome []byte) error {
	conn.Release()
	if t.handler == nil || !t.handler.committed.Load() {
		return errors.New("idemkey postgres: commit: the handler ended the transaction itself, so nothing was recorded, and a retry runs it again")
	}
	sql, args := t.record(outcome)
	if _, err := t.store.pool.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("idemkey postgres: commit: the handler committed the transaction itself, and recording its outcome failed: %w", t.store.translate(ctx, "commit", err))
	}
	return errors.New("idemkey postgres: commit: the handler committed the transaction itself, so its writes were not atomic with the record")
}

// Rollback implements store.Tx.
func (t *atomicTx) Rollback(ctx context.Context) error {
	conn := t.end()
	if conn == nil {
		return errTxEnded
	}
	defer t.store.freeSlot()
	return t.store.rollback(ctx, conn)
}

// handlerTx is the handler's Querier: the transaction's connection, cut off
// once the transaction has ended, so that a goroutine the handler left
// behind cannot write into the next call that uses the connection.
type handlerTx struct {
	conn      *pgx.Conn
	ended     atomic.Bool
	committed atomic.Bool // an Exec of the handler's committed the transaction
}

func (h *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.ended.Load() {
		return pgconn.CommandTag{}, errTxEnded
	}
	tag, err := h.conn.Exec(ctx, sql, args...)
	if tag.String() == "COMMIT" && h.conn.PgConn().TxStatus() == 'I' {
		h.committed.Store(true)
	}
	return tag, err
}

func (h *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if h.ended.Load() {
		return nil, errTxEnded
	}
	return h.conn.Query(ctx, sql, args...)
}

func (h *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.ended.Load() {
		return endedRow{}
	}
	return h.conn.QueryRow(ctx, sql, args...)
}

func (h *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if h.ended.Load() {
		return endedBatch{}
	}
	return h.conn.SendBatch(ctx, b)
}

func (h *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if h.ended.Load() {
		return 0, errTxEnded
	}
	return h.conn.CopyFrom(ctx, table, columns, src)
}

type endedRow struct{}

func (endedRow) Scan(...any) error { return errTxEnded }

type endedBatch struct{}

func (endedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, errTxEnded }
func (endedBatch) Query() (pgx.Rows, error)         { return nil, errTxEnded }
func (endedBatch) QueryRow() pgx.Row                { return endedRow{} }
func (endedBatch) Close() error                     { return errTxEnded }
func (endedBatch) Tx() pgx.Tx                       { return nil }
