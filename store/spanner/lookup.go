package spanner

import (
	"context"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/idemkey/idemkey/store"
)

var _ store.Looker = (*Store)(nil)

// lookupSQL reads what became of key @key, writing nothing: its unexpired
// record (completed, or in progress under a live lease or within its
// retention), the database's now, and the names of its finished, unexpired
// steps in byte order (Spanner orders STRING by its UTF-8 bytes).
const lookupSQL = `SELECT r.token IS NOT NULL, r.outcome IS NOT NULL, r.fingerprint, r.outcome, r.lease_end, r.expires_at, CURRENT_TIMESTAMP(),
	ARRAY(SELECT s.name FROM %[2]s AS s WHERE s.key = @key AND s.result IS NOT NULL AND s.expires_at > CURRENT_TIMESTAMP() ORDER BY s.name)
FROM UNNEST([1]) AS one LEFT JOIN %[1]s AS r
	ON r.key = @key AND (r.expires_at > CURRENT_TIMESTAMP() OR (r.outcome IS NULL AND r.lease_end > CURRENT_TIMESTAMP()))`

// Lookup implements store.Looker with one strong single-use read. A key an
// atomic call holds has its record in progress, committed before the
// handler ran (see Begin), and is told as a two-phase one is.
func (s *Store) Lookup(ctx context.Context, key store.Key) (store.Entry, []string, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	var (
		res       store.Entry
		found     bool
		steps     []string
		completed spanner.NullBool
	)
	err := s.client.Single().Query(ctx, spanner.Statement{SQL: s.lookupSQL, Params: map[string]any{"key": key[:]}}).Do(func(row *spanner.Row) error {
		var (
			fingerprint       []byte
			leaseEnd, expires spanner.NullTime
			now               time.Time
		)
		if err := row.Columns(&found, &completed, &fingerprint, &res.Outcome, &leaseEnd, &expires, &now, &steps); err != nil {
			return err
		}
		copy(res.Fingerprint[:], fingerprint)
		res.Expires = expires.Time
		res.State = store.Held
		if completed.Bool {
			res.State = store.Completed
		} else {
			res.RetryAfter = max(leaseEnd.Time.Sub(now), 0)
		}
		return nil
	})
	if err != nil {
		return store.Entry{}, nil, false, s.translate(ctx, "lookup", err)
	}
	if len(steps) == 0 {
		steps = nil
	}
	if !found {
		return store.Entry{}, steps, false, nil
	}
	return res, steps, true, nil
}
