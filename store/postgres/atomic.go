package postgres

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

// DefaultLockTimeout bounds how long Begin waits for another open transaction
// that holds the same key, unless WithLockTimeout sets another.
const DefaultLockTimeout = 100 * time.Millisecond

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

// savepoint separates the reservation from the handler's writes, so that a
// recorded error can undo the writes and keep the reservation.
const savepoint = "idemkey_handler"

// The reservation runs under the store's lock timeout; the handler's
// statements, under the session's own, which idemkey.lock_timeout keeps
// meanwhile.
const (
	setLockTimeoutSQL     = `SELECT set_config('idemkey.lock_timeout', current_setting('lock_timeout'), true), set_config('lock_timeout', $1, true)`
	restoreLockTimeoutSQL = `SELECT set_config('lock_timeout', current_setting('idemkey.lock_timeout'), true)`
)

// completeInTxSQL records the outcome like completeSQL, and fails when it
// matches no row (dividing by the count of rows updated), so that the COMMIT
// sent with it rolls back instead of committing the handler's writes without
// their record. Only a handler that changed the row itself gets there.
const completeInTxSQL = `WITH completed AS (%s RETURNING 1) SELECT 1 / count(*) FROM completed`

var _ store.Atomic = (*Store)(nil)

// Begin implements store.Atomic in one round trip once the connection has
// prepared the statements: BEGIN, the reservation under the lock timeout, and
// a savepoint go out as one pipeline. Another transaction that holds the key
// makes the reservation wait on its row; the wait ends when that transaction
// does, or with SQLSTATE 55P03 when the lock timeout passes. A replay, or an
// "in progress", is answered at once: its transaction wrote and locked
// nothing, so its ROLLBACK goes out in a goroutine that the caller does not
// wait for (it frees the connection, and the transaction's slot, when done).
//
// At most WithAtomicConns transactions are open at once. When all are taken
// by running handlers, Begin first reads the key (Find): a replay answers from
// that read, on a connection the transactions leave free, and only a new key
// waits for a transaction to end.
func (s *Store) Begin(ctx context.Context, r store.Reservation) (store.Result, store.Tx, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if !s.takeSlot() {
		if res, found, err := s.Find(ctx, r.Key); err != nil || found {
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

// begin is Begin once it holds a slot. A connection that is lost takes the
// transaction with it, so Begin starts again on another. ending reports that
// a goroutine is ending the transaction and frees the slot itself.
func (s *Store) begin(ctx context.Context, r store.Reservation) (res store.Result, tx store.Tx, ending bool, err error) {
	for range maxAttempts {
		conn, err := s.pool.Acquire(ctx)
		if err != nil {
			return store.Result{}, nil, false, s.translate(ctx, "begin", err)
		}
		res, err := s.reserveInTx(ctx, conn.Conn(), r)
		var pgErr *pgconn.PgError
		switch {
		case err == nil && res.State == store.Acquired:
			return res, &atomicTx{store: s, conn: conn, key: r.Key, token: res.Token}, false, nil
		case err == nil:
			// The reservation read the row and wrote nothing: the answer
			// need not wait for the ROLLBACK's round trip.
			go func() {
				s.rollback(ctx, conn)
				s.freeSlot()
			}()
			return res, nil, true, nil
		case errors.As(err, &pgErr) && pgErr.Code == "55P03" && ctx.Err() == nil:
			// The key's holder has not committed: its fingerprint cannot be
			// read, and its lease is unknown.
			s.rollback(ctx, conn)
			return store.Result{State: store.InProgress, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}, nil, false, nil
		case errors.Is(err, pgx.ErrNoRows) || serializationFailure(err):
			// The row changed under the statement: begin again. The
			// ROLLBACK goes on its own, because pgx prepares anew the
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
	return store.Result{}, nil, false, fmt.Errorf("idemkey postgres: begin: %w: the row changed, or the connection died, in %d attempts in a row", store.ErrUnavailable, maxAttempts)
}

// reserveInTx begins a transaction on conn and reserves r in it.
func (s *Store) reserveInTx(ctx context.Context, conn *pgx.Conn, r store.Reservation) (store.Result, error) {
	var (
		res     store.Result
		scanErr error
	)
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(setLockTimeoutSQL, s.lockTimeout)
	// The scan's error is kept apart, because pgx forgets the prepared
	// statements of a batch that fails, and no row is no failure of theirs.
	b.Queue(s.reserveSQL, r.Key[:], r.Fingerprint[:], r.Lease.Microseconds(), r.Retention.Microseconds()).
		QueryRow(func(row pgx.Row) error { res, scanErr = scanReservation(row); return nil })
	b.Queue(restoreLockTimeoutSQL)
	b.Queue("SAVEPOINT " + savepoint)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return store.Result{}, err
	}
	return res, scanErr
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
// the reservation it holds.
type atomicTx struct {
	store   *Store
	conn    *pgxpool.Conn // nil once the transaction has ended
	handler *handlerTx    // the handler's view of it, once it has one
	key     store.Key
	token   store.Token
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
// another.
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
	b := &pgx.Batch{}
	b.Queue(t.store.completeInTxSQL, t.key[:], int64(t.token), outcome)
	b.Queue("COMMIT").Exec(func(tag pgconn.CommandTag) error {
		if tag.String() != "COMMIT" {
			return errRolledBack
		}
		return nil
	})
	err := conn.SendBatch(ctx, b).Close()
	if err == nil {
		conn.Release()
		return nil
	}
	t.store.rollback(ctx, conn)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "22012": // completeInTxSQL's division by zero
		return fmt.Errorf("idemkey postgres: commit: %w: the handler changed the record's row, so nothing was committed", store.ErrLeaseLost)
	case errors.Is(err, errRolledBack):
		return fmt.Errorf("idemkey postgres: commit: %w", err)
	}
	return t.store.translate(ctx, "commit", err)
}

// handlerEnded records outcome after a handler ended the transaction itself.
// If it committed, its writes and the reservation are in, and the record
// completes them, as in two-phase mode; if it rolled back, the reservation
// is gone, and so is the key's hold. Either way the error reports the bug.
func (t *atomicTx) handlerEnded(ctx context.Context, conn *pgxpool.Conn, outcome []byte) error {
	conn.Release()
	err := t.store.Complete(ctx, t.key, t.token, outcome)
	if err != nil && !errors.Is(err, store.ErrLeaseLost) {
		return fmt.Errorf("idemkey postgres: commit: the handler ended the transaction, and recording its outcome failed: %w", err)
	}
	return errors.New("idemkey postgres: commit: the handler ended the transaction itself, so its writes were not atomic with the record")
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
	conn  *pgx.Conn
	ended atomic.Bool
}

func (h *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.ended.Load() {
		return pgconn.CommandTag{}, errTxEnded
	}
	return h.conn.Exec(ctx, sql, args...)
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
