package postgres

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

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

// BeginBatch implements store.BatchAtomic with one transaction: BEGIN and a
// probe of every key go out as one pipeline, each key decided as Begin
// decides one. The batch takes one WithAtomicConns slot whatever its size,
// waiting for one as Begin does. Each call's writes are kept apart by a
// savepoint of its own, sent with its handler's first statement, and Commit
// writes every record with COMMIT: n calls cost n+2 round trips and one
// commit (docs/postgres.md, "Batches of atomic calls").
func (s *Store) BeginBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, store.BatchTx, error) {
	if len(rs) == 0 {
		return nil, nil, nil
	}
	args, err := batchArgs(rs)
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	slot, probe := s.claim()
	if probe {
		res, err := s.probeBatch(ctx, rs, args)
		if err != nil || !anyAcquired(res) {
			return res, nil, err
		}
		if err := s.awaitSlot(ctx); err != nil {
			return nil, nil, err
		}
		slot = true
	}
	res, tx, ending, err := s.beginBatch(ctx, rs, args, slot)
	if tx == nil && !ending {
		s.unclaim(slot)
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

func anyAcquired(res []store.Entry) bool {
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
func (s *Store) probeBatch(ctx context.Context, rs []store.Reservation, args []any) ([]store.Entry, error) {
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
func results(ps []probed) (res []store.Entry, takeover []bool) {
	res, takeover = make([]store.Entry, len(ps)), make([]bool, len(ps))
	for i, p := range ps {
		res[i], takeover[i] = p.res, p.takeover
	}
	return res, takeover
}

// beginBatch is BeginBatch once it holds a slot or a lent connection's
// place, as begin is Begin's.
func (s *Store) beginBatch(ctx context.Context, rs []store.Reservation, args []any, slot bool) (res []store.Entry, tx *batchTx, ending bool, err error) {
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
			if err := s.seat(ctx, conn, slot); err != nil {
				return nil, nil, false, err
			}
			return res, newBatchTx(s, conn, rs, res, takeover), false, nil
		case err == nil:
			go func() {
				s.rollback(ctx, conn)
				s.unclaim(slot)
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
