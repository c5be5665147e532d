package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkey/idemkey/store"
)

var _ store.Looker = (*Store)(nil)

// busyRetryAfter is the wait Lookup tells of a key that an atomic call
// holds: its lease is not written anywhere, so a short fixed wait, which
// the engine bounds by its WithMaxRetryAfter.
const busyRetryAfter = time.Second

// lookupSQL reads what became of key $1 in one statement that writes
// nothing: its unexpired record (completed, or in progress under a live
// lease or within its retention), the names of its finished, unexpired
// steps in byte order, and, only without a record, whether an atomic call
// holds the key: it tries the key's advisory lock ($2, see lockID) in
// share mode without waiting, as probeSQL does. The statement runs on its
// own (autocommit), so the lock, if taken, goes with it.
//
// Result columns: completed, fingerprint, outcome, time left on the lease
// and expiry (NULL without a record), busy, and the steps' names.
func lookupSQL(table, steps string) string {
	return fmt.Sprintf(`
SELECT c.state = 'completed', c.fingerprint, c.outcome, c.lease_end - now(), c.expires_at,
	CASE WHEN c.key IS NULL THEN NOT %[3]s ELSE false END,
	ARRAY(SELECT s.name FROM %[2]s AS s WHERE s.key = $1 AND s.result IS NOT NULL AND s.expires_at > now() ORDER BY s.name COLLATE "C")
FROM (VALUES (1)) AS one (x) LEFT JOIN %[1]s AS c
	ON c.key = $1 AND (c.expires_at > now() OR (c.state = 'in_progress' AND c.lease_end > now()))`,
		table, steps, tryLock("$2", table, true))
}

// Lookup implements store.Looker in one round trip (lookupSQL), run again
// after a serialization failure or on a fresh connection (reconnect), as
// Find is.
//
// A key that a running atomic call holds has no record until it commits:
// Lookup tells it Held, with no fingerprint or expiry and a RetryAfter of
// one second, from the key's advisory lock, which it tries in share mode
// without waiting. The running call never waits for it, nor fails: it
// holds the lock already, and the try fails at once. A Begin of the same
// key made in the very instant of the statement may find the shared lock
// and be told "in progress" as a duplicate would; the engine then polls the
// key again, as it does a duplicate's, and acquires it.
func (s *Store) Lookup(ctx context.Context, key store.Key) (store.Entry, []string, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var (
		completed   pgtype.Bool
		fingerprint []byte
		res         store.Entry
		leaseLeft   pgtype.Interval
		expires     pgtype.Timestamptz
		busy        bool
		steps       []string
	)
	query := func() error {
		return s.pool.QueryRow(ctx, s.lookupSQL, key[:], lockID(key)).
			Scan(&completed, &fingerprint, &res.Outcome, &leaseLeft, &expires, &busy, &steps)
	}
	err := query()
	for attempt := 1; attempt < maxAttempts && (serializationFailure(err) || reconnect(err)); attempt++ {
		err = query()
	}
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return store.Entry{}, nil, false, s.translate(ctx, "lookup", err)
	}
	if len(steps) == 0 {
		steps = nil
	}
	switch {
	case busy:
		return store.Entry{State: store.Held, RetryAfter: busyRetryAfter}, steps, true, nil
	case !completed.Valid:
		return store.Entry{}, steps, false, nil
	case completed.Bool:
		res.State = store.Completed
	default:
		res.State, res.RetryAfter, res.Outcome = store.Held, intervalDuration(leaseLeft), nil
	}
	copy(res.Fingerprint[:], fingerprint)
	res.Expires = expires.Time
	return res, steps, true, nil
}
