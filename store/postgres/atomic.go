package postgres

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/hex"
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

// Querier is the call's transaction, through which a handler in atomic mode
// reads and writes. Its methods are pgx's, so it fits sqlc's DBTX, and a
// *pgxpool.Pool or pgx.Tx is one too. It has no Commit or Rollback: the
// engine ends it with the record. It is for one goroutine at a time, and
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

// ContextWithTx returns ctx carrying tx, for TxFromContext: to run a handler
// outside an entry point (a test, a batch job) in a transaction of its own.
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
// whether the key is free, and lets the lock go at once. It tries the lock
// in share mode, which conflicts with a running call's lock alone, so that
// holdersSQL never takes a probe for the key's holder (a batch runs the
// probe in its transaction too, batchProbeSQL, with exclusive locks that
// it keeps).
//
// Result columns: kind, then the record's fingerprint, outcome, time left
// on its lease and expiry (NULL without a record), and the statement's
// now(), its transaction's start.
func probeSQL(table string) string {
	return fmt.Sprintf(`
SELECT CASE
		WHEN c.key IS NULL THEN CASE WHEN %[8]s THEN %[3]d ELSE %[4]d END
		WHEN %[2]s THEN CASE WHEN %[8]s THEN %[5]d ELSE %[4]d END
		WHEN c.state = 'completed' THEN %[6]d
		ELSE %[7]d END,
	c.fingerprint, c.outcome, c.lease_end - now(), c.expires_at, now()
FROM (VALUES (1)) AS one (x) LEFT JOIN %[1]s AS c ON c.key = $1`,
		table, takeable("c"), probeFree, probeBusy, probeTakeable, probeCompleted, probeHeld, tryLock("$3", table, true))
}

// lockSQL tries the key's advisory lock ($1, see lockID) without waiting:
// the lock is what a running atomic call holds instead of a row, until its
// transaction ends. It answers too when the transaction started (its
// now()), for the expiry of the record it writes (expiresOnRecord).
func lockSQL(table string) string {
	return "SELECT " + tryLock("$1", table, false) + ", now()"
}

// tryLock is the SQL that tries, without waiting, the advisory lock of the
// key whose lockID the expression id holds, on table (lockKey): exclusive,
// or with shared in share mode.
func tryLock(id, table string, shared bool) string {
	if shared {
		return "pg_try_advisory_xact_lock_shared(" + lockKey(id, table) + ")"
	}
	return "pg_try_advisory_xact_lock(" + lockKey(id, table) + ")"
}

// lockKey is the SQL of the advisory lock of the key whose lockID the
// expression id holds, on table: XORed with the table's OID, so that two
// stores' tables never share a key's lock.
func lockKey(id, table string) string {
	return fmt.Sprintf(`(%s # '%s'::regclass::oid::bigint)`, id, table)
}

// holdersSQL reads when the transactions that hold the locks of the keys
// whose lockIDs are $1 started, of those that started before $2: rows of
// lockID and pg_stat_activity's xact_start. A transaction's now() is its
// start, so the record that such a transaction writes expires at that
// instant plus the retention (recordSQL), which a duplicate can tell
// before the record is written (expiresOnRecord).
//
// pg_locks shows an advisory lock of one bigint with its high half as
// classid, its low half as objid, and objsubid 1. Only exclusive locks are
// read: the probe's own are in share mode, and record nothing. $2 is when
// the statement that found the locks held started: a transaction that
// started later is not the one that held a lock then, but one that took it
// since (or the holder's connection, in its next transaction), and is left
// out. xact_start is NULL, and the row left out too, where the reader may
// not see the holder's session: pg_stat_activity hides another role's
// unless the reader has pg_read_all_stats.
func holdersSQL(table string) string {
	return fmt.Sprintf(`SELECT h.id, a.xact_start
FROM (SELECT ((k.classid::bigint << 32) | k.objid::bigint) # '%s'::regclass::oid::bigint AS id, k.pid
	FROM pg_locks AS k
	WHERE k.locktype = 'advisory' AND k.mode = 'ExclusiveLock' AND k.granted AND k.objsubid = 1
		AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())) AS h
	JOIN pg_stat_activity AS a ON a.pid = h.pid
WHERE h.id = ANY($1::bigint[]) AND a.xact_start < $2`, table)
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
// takeable and expiry; no row without a record.
func readSQL(table string) string {
	return fmt.Sprintf(`SELECT c.state = 'completed', c.fingerprint, c.outcome, c.lease_end - now(), %[2]s, c.expires_at
FROM %[1]s AS c WHERE c.key = $1`, table, takeable("c"))
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
// tryLock XORs with the table's OID, so that two tables' stores never share
// a lock. The one-bigint form's space is shared with the application's own
// locks of that form (docs/postgres.md).
func lockID(key store.Key) int64 { return int64(binary.BigEndian.Uint64(key[:8])) }

var _ store.Atomic = (*Store)(nil)

// Begin implements store.Atomic in one round trip once the connection has
// prepared the statements: BEGIN, the key's lock tried without waiting
// (lockSQL), its record read (readSQL) and a savepoint, as one pipeline.
// Nothing waits: a duplicate is answered "in progress" at once, a replay
// from the record, and a call not acquired is rolled back in a goroutine
// the caller does not wait for.
//
// When every slot (WithAtomicConns) is taken, Begin still decides the call
// on a free connection (claim), and a new key waits there for a slot; only
// when that would leave the pool no connection free does it run the probe
// on its own first (docs/postgres.md, "Atomic mode").
func (s *Store) Begin(ctx context.Context, r store.Reservation) (res store.Entry, tx store.Tx, err error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	since := s.watch.heard.Load()
	defer func() {
		if err == nil && res.State == store.Acquired && s.watch.listening.Load() {
			s.watch.holds(r.Key, r.Lease, since, acquired) // a duplicate may ask this store to notify (watch.go)
		}
	}()
	slot, probe := s.claim()
	if probe {
		if res, err = s.probe(ctx, r); err != nil || res.State != store.Acquired {
			if err == nil && res.State == store.Held && s.watch.listening.Load() {
				s.watch.holds(r.Key, max(res.RetryAfter, r.Lease), since, heldSilent) // told only at a poll: see watch.go
			}
			return res, nil, err
		}
		if err := s.awaitSlot(ctx); err != nil {
			return store.Entry{}, nil, err
		}
		slot = true
	}
	var ending bool
	res, tx, ending, err = s.begin(ctx, r, slot, since)
	if tx == nil && !ending {
		s.unclaim(slot)
	}
	return res, tx, err
}

// claim finds room for an atomic transaction: a free slot; else a lent
// connection to wait for a slot on, while the calls lent so leave one
// connection free for the statements that hold no slot; else probe is set,
// and the call probes first, waiting for a slot without a connection.
func (s *Store) claim() (slot, probe bool) {
	if s.takeSlot() {
		return true, false
	}
	if s.lent.Add(1) <= s.lendable {
		st := s.pool.Stat()
		if st.IdleConns()+st.MaxConns()-st.TotalConns() >= 2 {
			return false, false
		}
	}
	s.lent.Add(-1)
	s.probed.Add(1)
	return false, true
}

func (s *Store) unclaim(slot bool) {
	if slot {
		s.freeSlot()
	} else {
		s.lent.Add(-1)
	}
}

// lendable is how many calls may wait for a slot in a transaction on a
// connection of a pool of size connections, slots of which the slots take:
// all the others but one.
func lendable(size int32, slots int) int64 { return max(int64(size)-int64(slots)-1, 0) }

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

func (s *Store) awaitSlot(ctx context.Context) error {
	select {
	case s.slots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return s.translate(ctx, "begin", ctx.Err())
	}
}

// seat gives a transaction that claim lent a connection (slot unset), and
// that acquired a key, its slot: it waits for one until ctx ends, in the
// transaction, and then gives the lent connection's place back. If ctx
// ends first, the transaction rolls back.
func (s *Store) seat(ctx context.Context, conn *pgxpool.Conn, slot bool) error {
	if slot {
		return nil
	}
	if err := s.awaitSlot(ctx); err != nil {
		s.rollback(ctx, conn)
		return err
	}
	s.lent.Add(-1)
	return nil
}

// probe runs probeSQL for r on its own (autocommit), running it again on a
// fresh connection if its own died (reconnect).
func (s *Store) probe(ctx context.Context, r store.Reservation) (store.Entry, error) {
	var (
		p   probed
		err error
	)
	for range maxAttempts {
		p, err = scanProbe(s.pool.QueryRow(ctx, s.probeSQL, r.Key[:], r.Fingerprint[:], lockID(r.Key)), r)
		if !reconnect(err) {
			break
		}
	}
	if err != nil {
		return store.Entry{}, s.translate(ctx, "begin", err)
	}
	ps := []probed{p}
	s.tellHolders(ctx, []store.Reservation{r}, ps)
	return ps[0].res, nil
}

// probed is how a probe, or Begin's lock and read, decided one key.
type probed struct {
	res      store.Entry
	takeover bool      // the key's record is taken over
	busy     bool      // another transaction holds the key's lock: res.Expires is that transaction's (tellHolders)
	recorded time.Time // the key's record's expiry; zero without one
	started  time.Time // when the transaction that decided it started
}

// scanProbe reads the row of probeSQL for r.
func scanProbe(row pgx.Row, r store.Reservation) (probed, error) {
	var (
		kind        int
		fingerprint []byte
		leaseLeft   pgtype.Interval
		recorded    pgtype.Timestamptz
		p           probed
	)
	if err := row.Scan(&kind, &fingerprint, &p.res.Outcome, &leaseLeft, &recorded, &p.started); err != nil {
		return probed{}, err
	}
	p.recorded = recorded.Time
	switch kind {
	case probeFree, probeTakeable:
		p.res = store.Entry{State: store.Acquired, Expires: expiresOnRecord(r, p.started, p.recorded)}
		p.takeover = kind == probeTakeable
		return p, nil
	case probeBusy:
		// The running call's record is not written yet: its fingerprint
		// cannot be read, and its lease is unknown.
		p.res = store.Entry{State: store.Held, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}
		p.busy = true
		return p, nil
	case probeCompleted:
		p.res.State = store.Completed
	default:
		p.res.State, p.res.RetryAfter = store.Held, intervalDuration(leaseLeft)
	}
	copy(p.res.Fingerprint[:], fingerprint)
	p.res.Expires = p.recorded
	return p, nil
}

// expiresOnRecord is when the record of r's key expires once the
// transaction that holds the key's lock, which started at started,
// records it, as recordSQL and takeoverSQL write it: a record found
// (recorded, its expiry; zero without one) that expires after started
// keeps its expiry, else started plus the retention. Zero if started is
// unknown.
func expiresOnRecord(r store.Reservation, started, recorded time.Time) time.Time {
	switch {
	case started.IsZero():
		return time.Time{}
	case recorded.After(started):
		return recorded
	}
	return started.Add(time.Duration(retention(r)) * time.Microsecond)
}

// tellHolders sets the expiry of each key of ps found busy from when its
// holder's transaction started (holdersSQL), in one statement for all: a
// statement that reads pg_locks costs its executor's start-up even in a
// branch never run, so it is not part of the lock's. Where the start cannot
// be read, the expiry stays zero rather than a wrong instant.
func (s *Store) tellHolders(ctx context.Context, rs []store.Reservation, ps []probed) {
	var (
		ids    []int64
		before time.Time
	)
	for i, p := range ps {
		if p.busy {
			ids, before = append(ids, lockID(rs[i].Key)), p.started
		}
	}
	if len(ids) == 0 {
		return
	}
	started := make(map[int64]time.Time, len(ids))
	rows, _ := s.pool.Query(ctx, s.holdersSQL, ids, before)
	var (
		id int64
		at time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &at}, func() error { started[id] = at; return nil }); err != nil {
		return
	}
	for i := range ps {
		if ps[i].busy {
			ps[i].res.Expires = expiresOnRecord(rs[i], started[lockID(rs[i].Key)], ps[i].recorded)
		}
	}
}

type keyRecord struct {
	completed, takeable bool
	fingerprint         []byte
	outcome             []byte
	leaseLeft           pgtype.Interval
	expires             time.Time
	dest                [6]any // scan's destinations, here so that Scan's arguments take no allocation of their own
}

// scan reads the row of readSQL; found is false without a record.
func (c *keyRecord) scan(row pgx.Row) (found bool, err error) {
	c.dest = [6]any{&c.completed, &c.fingerprint, &c.outcome, &c.leaseLeft, &c.takeable, &c.expires}
	err = row.Scan(c.dest[:]...)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// decide is Begin's answer for r, given whether it took the key's lock,
// when its transaction started (lockSQL's), and the key's record, if
// found: a live record answers the call; otherwise the lock's holder runs
// it (a record found is taken over), and without the lock another call
// does: "in progress", with r's own fingerprint, since the running call's
// record is not written yet, a lease unknown, and an expiry that
// tellHolders reads.
func (c *keyRecord) decide(r store.Reservation, locked, found bool, started time.Time) probed {
	p := probed{started: started}
	if found {
		p.recorded = c.expires
	}
	switch {
	case found && !c.takeable && c.completed:
		p.res = store.Entry{State: store.Completed, Outcome: c.outcome, Expires: c.expires}
		copy(p.res.Fingerprint[:], c.fingerprint)
	case found && !c.takeable:
		p.res = store.Entry{State: store.Held, RetryAfter: intervalDuration(c.leaseLeft), Expires: c.expires}
		copy(p.res.Fingerprint[:], c.fingerprint)
	case locked:
		p.res, p.takeover = store.Entry{State: store.Acquired, Expires: expiresOnRecord(r, started, p.recorded)}, found
	default:
		p.res, p.busy = store.Entry{State: store.Held, Fingerprint: r.Fingerprint, RetryAfter: r.Lease}, true
	}
	return p
}

// beginRead is what begin's pipeline reads: the lock's answer and the
// key's record.
type beginRead struct {
	locked, found bool
	started       time.Time // the transaction's, from lockSQL
	rec           keyRecord
	err           error  // the scans'
	lockDest      [2]any // the lock's scan's destinations, as keyRecord's
}

// begin is Begin once it holds a slot, or a lent connection's place (slot
// unset), which it trades for a slot if it acquires the key (seat). A
// connection that is lost takes the transaction with it, so Begin starts
// again on another. ending reports that a goroutine is ending the
// transaction and gives back what claim took itself.
func (s *Store) begin(ctx context.Context, r store.Reservation, slot bool, since uint64) (res store.Entry, tx store.Tx, ending bool, err error) {
	for range maxAttempts {
		conn, err := s.pool.Acquire(ctx)
		if err != nil {
			return store.Entry{}, nil, false, s.translate(ctx, "begin", err)
		}
		t := newAtomicTx(s, r) // one allocation for all the scans write, and the transaction if it acquires the key
		a := &t.read
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		// The scans' errors are kept apart, because pgx forgets the prepared
		// statements of a batch that fails, and no row is no failure of theirs.
		b.Queue(s.lockSQL, lockID(r.Key)).QueryRow(func(row pgx.Row) error {
			a.lockDest = [2]any{&a.locked, &a.started}
			a.err = row.Scan(a.lockDest[:]...)
			return nil
		})
		b.Queue(s.readSQL, t.args[:2]...).QueryRow(func(row pgx.Row) error {
			var err error
			a.found, err = a.rec.scan(row)
			a.err = cmp.Or(a.err, err)
			return nil
		})
		b.Queue("SAVEPOINT " + savepoint)
		err = conn.SendBatch(ctx, b).Close()
		if err == nil {
			err = a.err
		}
		p := a.rec.decide(r, a.locked, a.found, a.started)
		switch {
		case err == nil && p.res.State == store.Acquired:
			if err := s.seat(ctx, conn, slot); err != nil {
				return store.Entry{}, nil, false, err
			}
			t.conn, t.handler.conn, t.takeover = conn, conn.Conn(), p.takeover
			return p.res, t, false, nil
		case err == nil:
			// The call wrote nothing, and a lock it took matters to no
			// one (the key's record answers every other call): the answer
			// need not wait for the ROLLBACK's round trip. A duplicate of a
			// running call asks the holder, with it, to notify its record
			// (watch.go).
			var ask string // the question, if any
			if p.res.State == store.Held && s.watch.listening.Load() && s.watch.holds(r.Key, max(p.res.RetryAfter, r.Lease), since, heldAsking) {
				ask = askPrefix + hex.EncodeToString(r.Key[:])
			}
			go func() {
				if ask != "" {
					s.rollbackNotifying(ctx, conn, ask)
				} else {
					s.rollback(ctx, conn)
				}
				s.unclaim(slot)
			}()
			ps := []probed{p}
			s.tellHolders(ctx, []store.Reservation{r}, ps)
			return ps[0].res, nil, true, nil
		case serializationFailure(err):
			// The ROLLBACK goes on its own, because pgx prepares anew the
			// statements of a batch that failed, which PostgreSQL refuses
			// inside a failed transaction.
			if err := s.rollback(ctx, conn); err != nil {
				return store.Entry{}, nil, false, err
			}
		case reconnect(err):
			conn.Release() // the pool closes it; the transaction died with it
		default:
			s.rollback(ctx, conn)
			return store.Entry{}, nil, false, s.translate(ctx, "begin", err)
		}
	}
	return store.Entry{}, nil, false, fmt.Errorf("idemkey postgres: begin: %w: the connection died, or the transaction failed to serialize, in %d attempts in a row", store.ErrUnavailable, maxAttempts)
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

// rollbackNotifying is rollback, with a notification of payload on the
// table's channel in the same round trip (watch.go): a duplicate's question
// to the holder of a key, or the holder's word that the key is free.
func (s *Store) rollbackNotifying(ctx context.Context, conn *pgxpool.Conn, payload string) error {
	defer conn.Release()
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	b := &pgx.Batch{}
	b.Queue("ROLLBACK")
	b.Queue(s.notifySQL, payload)
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		return s.translate(ctx, "rollback", err)
	}
	return nil
}

// atomicTx is the store.Tx of Begin: the connection in the transaction, and
// the reservation it decided. begin makes it before it knows whether the
// call acquires the key, so that what its pipeline reads, the handler's
// view and the transaction take one allocation.
type atomicTx struct {
	store    *Store
	conn     *pgxpool.Conn // nil once the transaction has ended
	handler  handlerTx     // the handler's view of it
	r        store.Reservation
	takeover bool // the probe found a record to take over
	read     beginRead
	// args are the arguments of the record's statement (record): r's key
	// and fingerprint, which Begin's read takes too, boxed once for both,
	// then the outcome and the retention.
	args [4]any
}

func newAtomicTx(s *Store, r store.Reservation) *atomicTx {
	t := &atomicTx{store: s, r: r}
	t.args[0], t.args[1] = t.r.Key[:], t.r.Fingerprint[:]
	return t
}

var (
	errTxEnded    = errors.New("idemkey postgres: the transaction has already ended")
	errRolledBack = errors.New("the transaction had failed, so COMMIT rolled it back")
)

// HandlerContext implements store.Tx: TxFromContext finds the transaction in
// the context it returns.
func (t *atomicTx) HandlerContext(ctx context.Context) context.Context {
	return ContextWithTx(ctx, &t.handler)
}

// end takes the connection for ending the transaction, and cuts the
// handler's view of it off.
func (t *atomicTx) end() *pgxpool.Conn {
	conn := t.conn
	t.conn = nil
	t.handler.ended.Store(true)
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
	defer t.store.ended(t.r.Key)
	if outcome == nil {
		outcome = []byte{} // pgx sends a nil slice as NULL, which means "in progress"
	}
	ctx, cancel := t.store.bound(context.WithoutCancel(ctx))
	defer cancel()
	return t.commit(ctx, conn, outcome, keepWrites)
}

// commit is Commit on conn, the transaction's connection, with ctx
// bounded; it ends the transaction and gives conn back. It is apart from
// Commit, whose deferred calls the compiler then makes plain calls at each
// return (open-coded defers), which it does only in a function with few
// returns.
func (t *atomicTx) commit(ctx context.Context, conn *pgxpool.Conn, outcome []byte, keepWrites bool) error {
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
	// A duplicate in another process asked to be told (watch.go).
	notify := t.store.watch.listening.Load() && t.store.watch.end(t.r.Key)
	if notify {
		b.Queue(t.store.notifySQL, hex.EncodeToString(t.r.Key[:]))
	}
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, recordErr := br.Exec()
	var notifyErr error
	if notify {
		_, notifyErr = br.Exec()
	}
	tag, commitErr := br.Exec()
	err := cmp.Or(recordErr, notifyErr, commitErr, br.Close())
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
// its arguments (t.args): an insert, or for a record Begin found takeable,
// the guarded takeover.
func (t *atomicTx) record(outcome []byte) (sql string, args []any) {
	sql = t.store.recordSQL
	if t.takeover {
		sql = t.store.takeoverSQL
	}
	t.args[2], t.args[3] = outcome, retention(t.r)
	return sql, t.args[:]
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
	if !t.handler.committed.Load() {
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
	defer t.store.ended(t.r.Key)
	if t.store.watch.listening.Load() && t.store.watch.end(t.r.Key) {
		// A duplicate asked to be told (watch.go): the key is free, and its
		// next Begin may acquire it.
		return t.store.rollbackNotifying(ctx, conn, hex.EncodeToString(t.r.Key[:]))
	}
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
