package postgres

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

// batchProbeSQL is probeSQL over a batch of keys: the arrays $1 (keys), $2
// (fingerprints) and $3 (lockID of each key), one row per key in their
// order, each decided as probeSQL decides one, with the locks tried
// exclusive or, with shared, in share mode, as probeSQL tries them on its
// own. The keys must be distinct: a transaction that holds an advisory lock
// takes it again.
//
// Each key's record is read by a lateral subquery with a LIMIT, which the
// planner cannot turn into a join of the whole table: a plain join, planned
// generically while the table was small or had no statistics (a new table),
// became a hash join over a scan of the table, kept by the connection's
// cached plan while the table grew (a batch's probe took 1.4 times the time
// of the batch's writes in BenchmarkBatchVsBaseline).
func batchProbeSQL(table string, shared bool) string {
	return fmt.Sprintf(`
SELECT CASE
		WHEN c.key IS NULL THEN CASE WHEN %[8]s THEN %[3]d ELSE %[4]d END
		WHEN %[2]s THEN CASE WHEN %[8]s THEN %[5]d ELSE %[4]d END
		WHEN c.state = 'completed' THEN %[6]d
		ELSE %[7]d END,
	c.fingerprint, c.outcome, c.lease_end - now(), c.expires_at, now()
FROM unnest($1::bytea[], $2::bytea[], $3::bigint[]) WITH ORDINALITY AS i (key, fingerprint, lock, n)
	LEFT JOIN LATERAL (
		SELECT k.key, k.fingerprint, k.state, k.outcome, k.lease_end, k.expires_at
		FROM %[1]s AS k WHERE k.key = i.key LIMIT 1
	) AS c ON true
ORDER BY i.n`,
		table, takeableBy("c", "i.fingerprint"), probeFree, probeBusy, probeTakeable, probeCompleted, probeHeld, tryLock("i.lock", table, shared))
}

// batchRecordSQL inserts, in one statement, the completed records of a
// batch's calls whose probe found no record, as recordSQL inserts one: the
// arrays $1 (keys), $2 (fingerprints), $3 (outcomes) and $4 (retentions in
// microseconds). A record of any of the keys inserted since makes the whole
// statement fail with a unique violation.
const batchRecordSQL = `INSERT INTO %s (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
SELECT r.key, r.fingerprint, 'completed', 0, now(), now(), now() + r.retention * interval '1 microsecond', r.outcome
FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::bigint[]) AS r (key, fingerprint, outcome, retention)`

var _ store.BatchAtomic = (*Store)(nil)

// BeginBatch implements store.BatchAtomic with one transaction, in one
// round trip once the connection has prepared the statements: BEGIN and one
// probe of every key (probeSQL over arrays) go out as one pipeline. Each key
// is decided as Begin decides one; the keys acquired are those whose
// advisory locks the transaction took. The batch takes one of the
// WithAtomicConns slots, whatever its size; when none is free, the probe
// runs first on its own, as in Begin, and the batch waits for a slot only
// if it acquires a key.
//
// The batch's transaction runs its calls one after another: each call's
// writes are kept apart by a savepoint of its own, nested in the previous
// call's and sent in one pipeline with the first statement of its handler,
// so that a call whose handler writes one row costs one round trip. Commit writes every record in one
// multi-row INSERT (and a guarded upsert for each key taken over), with
// COMMIT, in one more: a batch of n calls costs n+2 round trips and one
// commit, where n calls one at a time cost 3n round trips and n commits.
func (s *Store) BeginBatch(ctx context.Context, rs []store.Reservation) ([]store.Result, store.BatchTx, error) {
	if len(rs) == 0 {
		return nil, nil, nil
	}
	args, err := batchArgs(rs)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if !s.takeSlot() {
		res, err := s.probeBatch(ctx, rs, args)
		if err != nil || !anyAcquired(res) {
			return res, nil, err
		}
		select {
		case s.slots <- struct{}{}:
		case <-ctx.Done():
			return nil, nil, s.translate(ctx, "begin", ctx.Err())
		}
	}
	res, tx, ending, err := s.beginBatch(ctx, rs, args)
	if tx == nil && !ending {
		s.freeSlot()
	}
	if tx == nil { // a nil *batchTx is not a nil store.BatchTx
		return res, nil, err
	}
	return res, tx, err
}

// batchArgs are the probe's arrays for rs, whose keys must be distinct.
func batchArgs(rs []store.Reservation) ([]any, error) {
	keys, fingerprints, locks := make([][]byte, len(rs)), make([][]byte, len(rs)), make([]int64, len(rs))
	seen := make(map[store.Key]struct{}, len(rs))
	for i := range rs {
		if _, ok := seen[rs[i].Key]; ok {
			return nil, errors.New("idemkey postgres: begin: a batch holds one key twice; its reservations must have distinct keys")
		}
		seen[rs[i].Key] = struct{}{}
		keys[i], fingerprints[i], locks[i] = rs[i].Key[:], rs[i].Fingerprint[:], lockID(rs[i].Key)
	}
	return []any{keys, fingerprints, locks}, nil
}

func anyAcquired(res []store.Result) bool {
	for _, r := range res {
		if r.State == store.Acquired {
			return true
		}
	}
	return false
}

// probeBatch runs batchProbeSQL on its own, outside a transaction, so that
// the locks it takes, in share mode, are let go at once: it only asks which
// keys are free.
func (s *Store) probeBatch(ctx context.Context, rs []store.Reservation, args []any) ([]store.Result, error) {
	var (
		ps  []probed
		err error
	)
	for range maxAttempts {
		rows, _ := s.pool.Query(ctx, s.batchProbeAloneSQL, args...)
		ps, err = scanBatchProbe(rows, rs)
		if !reconnect(err) {
			break
		}
	}
	if err != nil {
		return nil, s.translate(ctx, "begin", err)
	}
	s.tellHolders(ctx, rs, ps)
	res, _ := results(ps)
	return res, nil
}

// scanBatchProbe reads the rows of batchProbeSQL for rs.
func scanBatchProbe(rows pgx.Rows, rs []store.Reservation) ([]probed, error) {
	defer rows.Close()
	ps := make([]probed, len(rs))
	n := 0
	for rows.Next() {
		if n == len(rs) {
			return nil, errors.New("idemkey postgres: begin: the probe answered more rows than the batch has keys")
		}
		var err error
		if ps[n], err = scanProbe(rows, rs[n]); err != nil {
			return nil, err
		}
		n++
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if n != len(rs) {
		return nil, errors.New("idemkey postgres: begin: the probe answered fewer rows than the batch has keys")
	}
	return ps, nil
}

// results are the answers of ps, and which of them take a record over.
func results(ps []probed) (res []store.Result, takeover []bool) {
	res, takeover = make([]store.Result, len(ps)), make([]bool, len(ps))
	for i, p := range ps {
		res[i], takeover[i] = p.res, p.takeover
	}
	return res, takeover
}

// beginBatch is BeginBatch once it holds a slot, as begin is Begin's.
func (s *Store) beginBatch(ctx context.Context, rs []store.Reservation, args []any) (res []store.Result, tx *batchTx, ending bool, err error) {
	for range maxAttempts {
		conn, err := s.pool.Acquire(ctx)
		if err != nil {
			return nil, nil, false, s.translate(ctx, "begin", err)
		}
		var (
			ps      []probed
			scanErr error
		)
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		b.Queue(s.batchProbeSQL, args...).Query(func(rows pgx.Rows) error {
			ps, scanErr = scanBatchProbe(rows, rs)
			return nil
		})
		err = conn.SendBatch(ctx, b).Close()
		if err == nil {
			err = scanErr
		}
		if err == nil {
			// On the pool, so that the batch's transaction, which keeps the
			// keys it acquired, never runs a statement that could fail it.
			s.tellHolders(ctx, rs, ps)
		}
		res, takeover := results(ps)
		switch {
		case err == nil && anyAcquired(res):
			return res, newBatchTx(s, conn, rs, res, takeover), false, nil
		case err == nil:
			go func() {
				s.rollback(ctx, conn)
				s.freeSlot()
			}()
			return res, nil, true, nil
		case serializationFailure(err):
			if err := s.rollback(ctx, conn); err != nil {
				return nil, nil, false, err
			}
		case reconnect(err):
			conn.Release()
		default:
			s.rollback(ctx, conn)
			return nil, nil, false, s.translate(ctx, "begin", err)
		}
	}
	return nil, nil, false, fmt.Errorf("idemkey postgres: begin: %w: the connection died, or the transaction failed to serialize, in %d attempts in a row", store.ErrUnavailable, maxAttempts)
}

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

func newBatchTx(s *Store, conn *pgxpool.Conn, rs []store.Reservation, res []store.Result, takeover []bool) *batchTx {
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

// batchHandler is a handler's Querier in a batch: the batch's connection,
// cut off once the handler's call has ended. Its first statement carries
// the batch's pending statements (the call's savepoint) ahead of it, in
// one pipeline.
type batchHandler struct {
	t     *batchTx
	ended atomic.Bool
}

// plain reports whether the handler's statement goes out as it is: nothing
// is pending, or the arguments start with one of pgx's options (a query
// mode, a rewriter), which pipelines do not take, so that the pending
// statements go first, on their own.
func (h *batchHandler) plain(ctx context.Context, args []any) (bool, error) {
	if len(h.t.pending) == 0 {
		return true, nil
	}
	if len(args) > 0 {
		switch args[0].(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter:
			return true, h.flush(ctx)
		}
	}
	return false, nil
}

// flush sends the pending statements on their own.
func (h *batchHandler) flush(ctx context.Context) error {
	pending := h.take()
	_, err := h.t.conn.Exec(ctx, strings.Join(pending, "; "))
	h.putBack(err, pending)
	return err
}

// take takes the pending statements, to send them.
func (h *batchHandler) take() []string {
	pending := h.t.pending
	h.t.pending = nil
	return pending
}

// putBack puts the pending statements back when what carried them failed
// and the transaction is not aborted: nothing of it ran on the server (pgx
// could not encode an argument, say), since a statement that fails in a
// transaction aborts it.
func (h *batchHandler) putBack(err error, pending []string) {
	if err != nil && h.t.conn != nil && h.t.conn.Conn().PgConn().TxStatus() == 'T' {
		h.t.pending = append(pending, h.t.pending...)
	}
}

// pipeline returns a batch of the pending statements, which it takes.
func (h *batchHandler) pipeline() (*pgx.Batch, []string) {
	pending := h.take()
	b := &pgx.Batch{}
	for _, sql := range pending {
		b.Queue(sql)
	}
	return b, pending
}

// sendPending sends b, which starts with the pending statements, and reads
// their results.
func (h *batchHandler) sendPending(ctx context.Context, b *pgx.Batch, pending []string) (pgx.BatchResults, error) {
	br := h.t.conn.SendBatch(ctx, b)
	for range pending {
		if _, err := br.Exec(); err != nil {
			br.Close()
			h.putBack(err, pending)
			return nil, err
		}
	}
	return br, nil
}

func (h *batchHandler) noteCommit(tag pgconn.CommandTag) {
	if tag.String() == "COMMIT" && h.t.conn != nil && h.t.conn.Conn().PgConn().TxStatus() == 'I' {
		h.t.committed.Store(true)
	}
}

func (h *batchHandler) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.ended.Load() {
		return pgconn.CommandTag{}, errTxEnded
	}
	plain, err := h.plain(ctx, args)
	switch {
	case err != nil:
		return pgconn.CommandTag{}, err
	case plain:
		tag, err := h.t.conn.Exec(ctx, sql, args...)
		h.noteCommit(tag)
		return tag, err
	case len(args) == 0:
		// pgx sends a statement without arguments in the simple protocol,
		// which takes several in one string, and answers the last one's tag.
		pending := h.take()
		tag, err := h.t.conn.Exec(ctx, strings.Join(pending, "; ")+"; "+sql)
		h.putBack(err, pending)
		h.noteCommit(tag)
		return tag, err
	}
	b, pending := h.pipeline()
	b.Queue(sql, args...)
	br, err := h.sendPending(ctx, b, pending)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	h.noteCommit(tag)
	return tag, err
}

func (h *batchHandler) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if h.ended.Load() {
		return nil, errTxEnded
	}
	plain, err := h.plain(ctx, args)
	switch {
	case err != nil:
		return nil, err
	case plain:
		return h.t.conn.Query(ctx, sql, args...)
	}
	b, pending := h.pipeline()
	b.Queue(sql, args...)
	br, err := h.sendPending(ctx, b, pending)
	if err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

// QueryRow sends its statement when the row is scanned, if statements are
// pending, so as to send them with it.
func (h *batchHandler) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.ended.Load() {
		return endedRow{}
	}
	if len(h.t.pending) == 0 {
		return h.t.conn.QueryRow(ctx, sql, args...)
	}
	return lazyRow{h: h, ctx: ctx, sql: sql, args: args}
}

func (h *batchHandler) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if h.ended.Load() {
		return endedBatch{}
	}
	if len(h.t.pending) == 0 {
		return h.t.conn.SendBatch(ctx, b)
	}
	nb, pending := h.pipeline()
	nb.QueuedQueries = append(nb.QueuedQueries, b.QueuedQueries...)
	br, err := h.sendPending(ctx, nb, pending)
	if err != nil {
		return failedBatch{err}
	}
	return br
}

func (h *batchHandler) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if h.ended.Load() {
		return 0, errTxEnded
	}
	if len(h.t.pending) > 0 {
		if err := h.flush(ctx); err != nil {
			return 0, err
		}
	}
	return h.t.conn.CopyFrom(ctx, table, columns, src)
}

// lazyRow is QueryRow's row while statements are pending: Scan runs the
// query, as a pgx row's Scan reads it.
type lazyRow struct {
	h    *batchHandler
	ctx  context.Context
	sql  string
	args []any
}

func (r lazyRow) Scan(dest ...any) error {
	rows, err := r.h.Query(r.ctx, r.sql, r.args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// batchRows are the rows of a query sent after pending statements: closing
// them closes the pipeline too.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
	err    error
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	r.Rows.Close()
	r.err = r.br.Close()
}

func (r *batchRows) Err() error { return cmp.Or(r.Rows.Err(), r.err) }

type failedBatch struct{ err error }

func (b failedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b failedBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b failedBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b failedBatch) Close() error                     { return b.err }
func (b failedBatch) Tx() pgx.Tx                       { return nil }

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
