package postgres

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

// batchTx is the store.BatchTx of BeginBatch. It is used by one goroutine
// at a time, the caller's; a handler's Querier is the only part that may be
// called from the handler's.
type batchTx struct {
	store    *Store
	conn     *pgxpool.Conn // nil once the transaction has ended
	rs       []store.Reservation
	acquired []bool
	takeover []bool
	outcomes [][]byte // the outcome of each call to record at Commit, else nil
	ended    []bool   // each call's handler has run, or started and ended

	cur     int           // the call whose handler runs, or -1
	handler *batchHandler // its view of the transaction
	// pending holds the statements sent ahead of the running handler's next
	// statement, in the same pipeline: the savepoint of the running call. A
	// call whose handler sends nothing never sends it.
	pending   []string
	committed atomic.Bool // a handler's Exec committed the transaction
	err       error       // what ended the transaction before Commit
}

func newBatchTx(s *Store, conn *pgxpool.Conn, rs []store.Reservation, res []store.Entry, takeover []bool) *batchTx {
	t := &batchTx{store: s, conn: conn, rs: rs, takeover: takeover, cur: -1,
		acquired: make([]bool, len(rs)), outcomes: make([][]byte, len(rs)), ended: make([]bool, len(rs))}
	for i, r := range res {
		t.acquired[i] = r.State == store.Acquired
	}
	return t
}

// savepointName is call i's savepoint. Each call has its own name, so that
// returning to it can never return to another call's: a call whose
// savepoint was never set (its first statement failed to parse, which
// fails the whole pipeline) fails to return to it, and the batch fails,
// rather than undo the call before it.
func savepointName(i int) string { return "idemkey_call_" + strconv.Itoa(i) }

// HandlerContext implements store.BatchTx. The savepoint of call i goes out
// with its handler's first statement.
func (t *batchTx) HandlerContext(ctx context.Context, i int) context.Context {
	if t.err == nil && t.cur >= 0 {
		t.fail(ctx, errors.New("idemkey postgres: a call of the batch started before the one before it ended"))
	}
	h := &batchHandler{t: t}
	if t.conn == nil || i < 0 || i >= len(t.rs) || !t.acquired[i] || t.ended[i] {
		h.ended.Store(true)
		return ContextWithTx(ctx, h)
	}
	t.cur, t.handler = i, h
	t.pending = append(t.pending, "SAVEPOINT "+savepointName(i))
	return ContextWithTx(ctx, h)
}

// endCall ends call i's handler, and cuts its view of the transaction off.
func (t *batchTx) endCall(i int) error {
	if t.conn == nil {
		return cmp.Or(t.err, errTxEnded)
	}
	if i != t.cur {
		return fmt.Errorf("idemkey postgres: call %d of the batch ended, but it is not the one running", i)
	}
	t.handler.ended.Store(true)
	t.cur, t.handler, t.ended[i] = -1, nil, true
	return nil
}

// unsent removes call i's savepoint from pending, and reports whether it
// was there: the handler sent no statement, and wrote nothing.
func (t *batchTx) unsent(i int) bool {
	if n := len(t.pending); n > 0 && t.pending[n-1] == "SAVEPOINT "+savepointName(i) {
		t.pending = t.pending[:n-1]
		return true
	}
	return false
}

// undo returns to call i's savepoint, undoing its writes, and releases it.
func (t *batchTx) undo(ctx context.Context, i int) error {
	if t.unsent(i) {
		return nil
	}
	// On its own, in the simple protocol (no arguments), which PostgreSQL
	// takes in a transaction that a failed statement left aborted.
	name := savepointName(i)
	if _, err := t.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+name+"; RELEASE SAVEPOINT "+name); err != nil {
		return t.fail(ctx, t.store.translate(ctx, "commit", err))
	}
	return nil
}

// check reports a transaction that the handler of call i ended or lost.
func (t *batchTx) check(ctx context.Context, i int, outcome []byte) error {
	pc := t.conn.Conn().PgConn()
	switch {
	case pc.IsClosed():
		return t.fail(ctx, fmt.Errorf("idemkey postgres: commit: %w: the batch's connection was lost", store.ErrUnavailable))
	case pc.TxStatus() == 'I':
		return t.handlerEnded(ctx, i, outcome)
	}
	return nil
}

// Record implements store.BatchTx. Keeping the writes costs nothing;
// undoing them costs a round trip.
func (t *batchTx) Record(ctx context.Context, i int, outcome []byte, keepWrites bool) error {
	if err := t.endCall(i); err != nil {
		return err
	}
	if outcome == nil {
		outcome = []byte{} // pgx sends a nil slice as NULL, which means "in progress"
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	if err := t.check(ctx, i, outcome); err != nil {
		return err
	}
	if keepWrites && t.conn.Conn().PgConn().TxStatus() == 'E' {
		if err := t.undo(ctx, i); err != nil {
			return err
		}
		return errors.New("idemkey postgres: commit: a statement of the handler failed, so its writes cannot commit, yet the handler succeeded; they were undone")
	}
	if keepWrites {
		// The savepoint stays: the next call's nests in it, and COMMIT
		// releases them all, which saves a statement per call. Undoing a
		// later call returns to that call's own savepoint, which keeps
		// this one's writes.
		t.unsent(i)
	} else if err := t.undo(ctx, i); err != nil {
		return err
	}
	t.outcomes[i] = outcome
	return nil
}

// Release implements store.BatchTx.
func (t *batchTx) Release(ctx context.Context, i int) error {
	if err := t.endCall(i); err != nil {
		return err
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	if err := t.check(ctx, i, nil); err != nil {
		return err
	}
	return t.undo(ctx, i)
}

// Commit implements store.BatchTx in one round trip: the records, in one
// statement (and one per key taken over), and COMMIT, which releases every
// call's savepoint, go out as one pipeline. A batch that records nothing
// rolls back.
func (t *batchTx) Commit(ctx context.Context) error {
	if t.conn == nil {
		return cmp.Or(t.err, errTxEnded)
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	if t.cur >= 0 {
		return t.fail(ctx, errors.New("idemkey postgres: commit: a call of the batch is still running"))
	}
	if pc := t.conn.Conn().PgConn(); pc.IsClosed() || pc.TxStatus() != 'T' {
		return t.fail(ctx, fmt.Errorf("idemkey postgres: commit: %w: the batch's transaction was lost or failed", store.ErrUnavailable))
	}
	b := &pgx.Batch{}
	if keys, fingerprints, outcomes, retentions := t.records(false); len(keys) > 0 {
		b.Queue(t.store.batchRecordSQL, keys, fingerprints, outcomes, retentions)
	}
	for i, outcome := range t.outcomes {
		if outcome != nil && t.takeover[i] {
			b.Queue(t.store.takeoverSQL, t.rs[i].Key[:], t.rs[i].Fingerprint[:], outcome, retention(t.rs[i]))
		}
	}
	if len(b.QueuedQueries) == 0 {
		t.finish(ctx)
		return nil
	}
	records := len(b.QueuedQueries)
	b.Queue("COMMIT")
	conn := t.conn
	br := conn.SendBatch(ctx, b)
	var recordErr error
	for range records {
		if _, err := br.Exec(); err != nil && recordErr == nil {
			recordErr = err
		}
	}
	tag, commitErr := br.Exec()
	err := cmp.Or(recordErr, commitErr, br.Close())
	if err == nil && tag.String() != "COMMIT" {
		err = errRolledBack
	}
	if err == nil {
		t.conn = nil
		conn.Release()
		t.store.freeSlot()
		return nil
	}
	t.finish(ctx)
	if recordErr != nil && lostRecord(recordErr) {
		return fmt.Errorf("idemkey postgres: commit: %w: another call recorded a key of the batch first, so nothing of the batch was committed", store.ErrLeaseLost)
	}
	if errors.Is(err, errRolledBack) {
		return fmt.Errorf("idemkey postgres: commit: %w", err)
	}
	return t.store.translate(ctx, "commit", err)
}

// records returns the arrays of batchRecordSQL for the calls to record
// whose probe found no record, or with takeover, those it takes over, in
// the keys' byte order: the order in which ReserveBatch inserts keys too,
// so that a batch of either mode that waits for the other's insert of a
// key they share (two modes on one operation, during a rolling deploy)
// never deadlocks with it.
func (t *batchTx) records(takeover bool) (keys, fingerprints, outcomes [][]byte, retentions []int64) {
	var calls []int
	for i, outcome := range t.outcomes {
		if outcome != nil && t.takeover[i] == takeover {
			calls = append(calls, i)
		}
	}
	slices.SortFunc(calls, func(a, b int) int { return bytes.Compare(t.rs[a].Key[:], t.rs[b].Key[:]) })
	for _, i := range calls {
		keys = append(keys, t.rs[i].Key[:])
		fingerprints = append(fingerprints, t.rs[i].Fingerprint[:])
		outcomes = append(outcomes, t.outcomes[i])
		retentions = append(retentions, retention(t.rs[i]))
	}
	return keys, fingerprints, outcomes, retentions
}

// Err implements store.BatchTx.
func (t *batchTx) Err() error { return t.err }

// Rollback implements store.BatchTx.
func (t *batchTx) Rollback(ctx context.Context) error {
	if t.conn == nil {
		return nil
	}
	if t.handler != nil {
		t.handler.ended.Store(true)
	}
	return t.finish(ctx)
}

// finish rolls the transaction back, if it is still open, and frees its
// connection and slot.
func (t *batchTx) finish(ctx context.Context) error {
	conn := t.conn
	if conn == nil {
		return nil
	}
	t.conn = nil
	defer t.store.freeSlot()
	return t.store.rollback(ctx, conn)
}

// fail ends the transaction for err, which every later method returns.
func (t *batchTx) fail(ctx context.Context, err error) error {
	if t.err == nil {
		t.err = err
	}
	if t.handler != nil {
		t.handler.ended.Store(true)
	}
	t.finish(ctx)
	return t.err
}

// handlerEnded ends a batch whose transaction the handler of call i ended
// itself. If a COMMIT of a handler's ended it, the writes of the calls
// before i, and i's, are in: their outcomes (i's is outcome, or nil if it
// was released) are recorded after the fact, as in two-phase mode, so that
// each call replays when decided again. Either way the batch fails, and
// its caller decides its calls again one at a time.
func (t *batchTx) handlerEnded(ctx context.Context, i int, outcome []byte) error {
	conn := t.conn
	t.conn = nil
	conn.Release()
	t.store.freeSlot()
	if !t.committed.Load() {
		t.err = errors.New("idemkey postgres: commit: a handler ended the batch's transaction itself, so nothing of the batch was recorded")
		return t.err
	}
	t.outcomes[i] = outcome
	b := &pgx.Batch{}
	if keys, fingerprints, outcomes, retentions := t.records(false); len(keys) > 0 {
		b.Queue(t.store.batchRecordSQL, keys, fingerprints, outcomes, retentions)
	}
	for j, outcome := range t.outcomes {
		if outcome != nil && t.takeover[j] {
			b.Queue(t.store.takeoverSQL, t.rs[j].Key[:], t.rs[j].Fingerprint[:], outcome, retention(t.rs[j]))
		}
	}
	for j := range t.outcomes {
		t.outcomes[j] = nil
	}
	t.err = errors.New("idemkey postgres: commit: a handler committed the batch's transaction itself, so the writes of its calls were not atomic with their records")
	if len(b.QueuedQueries) > 0 {
		if err := t.store.pool.SendBatch(ctx, b).Close(); err != nil {
			t.err = fmt.Errorf("idemkey postgres: commit: a handler committed the batch's transaction itself, and recording the outcomes of its calls failed: %w", t.store.translate(ctx, "commit", err))
		}
	}
	return t.err
}
