package postgres

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey/store"
)

// insertBatchSQL is insertSQL over a batch of keys: the arrays $1 (keys),
// $2 (fingerprints), $3 (leases) and $4 (retentions, both in
// microseconds). It answers one row per key, with the key's index in the
// arrays (from 1) first, then insertSQL's columns, and kind 0 for a key
// whose insert found a record that the statement's snapshot does not see
// (committed after it): the caller decides that key again on its own, as
// it does a record to take over (kind 4).
//
// The keys are inserted in the order of the arrays, which the caller
// sorts: two batches that share keys then wait for each other's inserts in
// one order, and never deadlock.
func insertBatchSQL(table, sequence string) string {
	return fmt.Sprintf(`
WITH i AS (
	SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::bigint[]) WITH ORDINALITY AS i (key, fingerprint, lease, retention, n)
), ins AS (
	INSERT INTO %[1]s (key, fingerprint, state, token, lease_end, created_at, expires_at)
	SELECT i.key, i.fingerprint, 'in_progress', nextval('%[2]s'),
		now() + i.lease * interval '1 microsecond', now(), now() + i.retention * interval '1 microsecond'
	FROM i ORDER BY i.n
	ON CONFLICT (key) DO NOTHING
	RETURNING key, token, expires_at
)
SELECT i.n,
	CASE WHEN ins.key IS NOT NULL THEN 1 WHEN c.key IS NULL THEN 0 WHEN %[3]s THEN 4 WHEN c.state = 'completed' THEN 2 ELSE 3 END,
	coalesce(ins.token, 0), c.fingerprint, c.outcome, c.lease_end - now(), coalesce(ins.expires_at, c.expires_at, now())
FROM i LEFT JOIN ins ON ins.key = i.key
	LEFT JOIN LATERAL (
		SELECT k.key, k.fingerprint, k.state, k.outcome, k.lease_end, k.expires_at
		FROM %[1]s AS k WHERE k.key = i.key LIMIT 1
	) AS c ON true
ORDER BY i.n`, table, sequence, takeableBy("c", "i.fingerprint"))
}

var _ store.BatchReserver = (*Store)(nil)

// ReserveBatch implements store.BatchReserver with one statement
// (insertBatchSQL): every key with no record is inserted in progress, and
// every other key's record answers from the statement's snapshot, as
// Reserve's insertSQL does one key. A record to take over, or one committed
// by another call while the statement ran, is decided with Reserve, one
// more round trip for each such key. Statements are run again on a fresh
// connection (reconnect), as Reserve's are.
func (s *Store) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	if len(rs) == 0 {
		return nil, nil
	}
	order, args, err := reserveBatchArgs(rs)
	if err != nil {
		return nil, err
	}
	bctx, cancel := s.bound(ctx)
	defer cancel()
	var (
		res   []store.Entry
		again []int // the reservations to decide on their own
	)
	for range maxAttempts {
		rows, _ := s.pool.Query(bctx, s.insertBatchSQL, args...)
		res, again, err = scanReserveBatch(rows, order)
		if !serializationFailure(err) && !reconnect(err) {
			break
		}
	}
	if err != nil {
		return nil, s.translate(bctx, "reserve", err)
	}
	for _, i := range again {
		if res[i], err = s.Reserve(ctx, rs[i]); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// reserveBatchArgs are insertBatchSQL's arrays for rs, sorted by key, and
// the index in rs of each of their keys. The keys must be distinct.
func reserveBatchArgs(rs []store.Reservation) (order []int, args []any, err error) {
	order = make([]int, len(rs))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return bytes.Compare(rs[a].Key[:], rs[b].Key[:]) })
	keys, fingerprints, leases, retentions := make([][]byte, len(rs)), make([][]byte, len(rs)), make([]int64, len(rs)), make([]int64, len(rs))
	for n, i := range order {
		if n > 0 && rs[i].Key == rs[order[n-1]].Key {
			return nil, nil, errors.New("idemkey postgres: reserve: a batch holds one key twice; its reservations must have distinct keys")
		}
		r := &rs[i]
		keys[n], fingerprints[n] = r.Key[:], r.Fingerprint[:]
		leases[n], retentions[n] = max(r.Lease, 0).Microseconds(), max(r.Retention, 0).Microseconds()
	}
	return order, []any{keys, fingerprints, leases, retentions}, nil
}

// scanReserveBatch reads the rows of insertBatchSQL, whose n-th key is
// that of reservation order[n-1]: each one's result, and the reservations
// it left to decide on their own.
func scanReserveBatch(rows pgx.Rows, order []int) (res []store.Entry, again []int, err error) {
	defer rows.Close()
	res = make([]store.Entry, len(order))
	seen := 0
	for rows.Next() {
		var n int64
		r, err := scanReservation(rowWithIndex{rows, &n})
		decideAlone := errors.Is(err, errTakeable) || errors.Is(err, errChanged)
		switch {
		case err != nil && !decideAlone:
			return nil, nil, err
		case n < 1 || n > int64(len(order)):
			return nil, nil, errors.New("idemkey postgres: reserve: the batch's statement answered a row for no key of the batch")
		case decideAlone:
			again = append(again, order[n-1])
		default:
			res[order[n-1]] = r
		}
		seen++
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	if seen != len(order) {
		return nil, nil, errors.New("idemkey postgres: reserve: the batch's statement answered fewer rows than the batch has keys")
	}
	return res, again, nil
}

// rowWithIndex is a row of insertBatchSQL as scanReservation reads
// reserveSQL's: its first column, the key's index, goes to n.
type rowWithIndex struct {
	pgx.Row
	n *int64
}

func (r rowWithIndex) Scan(dest ...any) error { return r.Row.Scan(append([]any{r.n}, dest...)...) }
