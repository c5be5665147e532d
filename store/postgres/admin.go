package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey/store"
)

// An operator's reads and deletes of the table, for cmd/idemkey (inspect,
// forget, stats, migrate down), so that the table's SQL has one owner and a
// migration changes one package. No call path of the engine uses them.
// Unlike the store.Store methods, their errors wrap the driver's (with the
// operation named), for an operator's tool to describe: the store sends
// only hashes, so none quotes a key or a tenant.

// Record is one row of the store's table as an operator sees it.
type Record struct {
	Key         store.Key
	Fingerprint []byte
	State       string // "in_progress" or "completed", as the table holds it
	Token       int64
	Created     time.Time
	LeaseEnd    time.Time
	Expires     time.Time
	Outcome     []byte    // as stored, sealed if the engine seals; nil in progress
	Now         time.Time // the database's clock when the row was read
}

const recordColumns = `key, fingerprint, state, token, created_at, lease_end, expires_at, outcome, now()`

func scanRecord(row pgx.Row) (Record, error) {
	var (
		r   Record
		key []byte
	)
	err := row.Scan(&key, &r.Fingerprint, &r.State, &r.Token, &r.Created, &r.LeaseEnd, &r.Expires, &r.Outcome, &r.Now)
	copy(r.Key[:], key)
	return r, err
}

// Records reads at most limit records whose keys lie in [from, to) (nil: no
// bound), in the keys' byte order, so that the primary key finds them. The
// record of one key k is the range from k to k with a zero byte appended. A
// limit of 0 reads none, but still fails on a missing table.
func (s *Store) Records(ctx context.Context, from, to []byte, limit int) ([]Record, error) {
	if from == nil {
		from = []byte{} // every key, not NULL
	}
	rows, _ := s.pool.Query(ctx, `SELECT `+recordColumns+` FROM `+s.table+`
		WHERE key >= $1 AND ($2::bytea IS NULL OR key < $2) ORDER BY key LIMIT $3`, from, to, max(limit, 0))
	recs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Record, error) { return scanRecord(row) })
	if err != nil {
		return nil, fmt.Errorf("idemkey postgres: records: %w", err)
	}
	return recs, nil
}

// Forget deletes the record of key if it is completed, in progress under a
// lease that has ended, or force is true, in one statement that decides
// whether it may, so that a call that reserves the key meanwhile is never
// deleted unseen. It returns the record as it was; a zero Record with
// deleted false means the key has no record.
func (s *Store) Forget(ctx context.Context, key store.Key, force bool) (rec Record, deleted bool, err error) {
	for range 3 {
		rec, err = scanRecord(s.pool.QueryRow(ctx, `DELETE FROM `+s.table+`
			WHERE key = $1 AND (state = 'completed' OR lease_end <= now() OR $2)
			RETURNING `+recordColumns, key[:], force))
		if err == nil {
			return rec, true, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Record{}, false, fmt.Errorf("idemkey postgres: forget: %w", err)
		}
		// Not deleted: absent, or in progress under a live lease. Read which;
		// if it changed in between, decide again.
		rec, err = scanRecord(s.pool.QueryRow(ctx, `SELECT `+recordColumns+` FROM `+s.table+` WHERE key = $1`, key[:]))
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return Record{}, false, nil
		case err != nil:
			return Record{}, false, fmt.Errorf("idemkey postgres: forget: %w", err)
		case rec.State == "in_progress" && rec.LeaseEnd.After(rec.Now):
			return rec, false, nil
		}
	}
	return Record{}, false, errors.New("idemkey postgres: forget: the record kept changing: try again")
}

// Stats are the table's counts and sizes, read in one scan of the table.
type Stats struct {
	Completed      int64
	InProgress     int64
	InProgressLive int64 // of InProgress, under a lease that has not ended
	Expired        int64 // counted as absent (Sweep's condition), waiting for a sweep
	// OldestLive is when the oldest record in progress under a live lease
	// was created; zero if none.
	OldestLive time.Time
	Now        time.Time // the database's clock
	TotalBytes int64     // table, indexes and TOAST
	TableBytes int64
	Indexes    map[string]int64 // each index's size in bytes, by name
}

// Stats counts the table's records by state, and measures the table and
// its indexes.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	var (
		st     = Stats{Indexes: map[string]int64{}}
		oldest *time.Time
	)
	err := s.pool.QueryRow(ctx, `SELECT
		count(*) FILTER (WHERE state = 'completed'),
		count(*) FILTER (WHERE state = 'in_progress'),
		count(*) FILTER (WHERE state = 'in_progress' AND lease_end > now()),
		count(*) FILTER (WHERE expires_at <= now() AND (state = 'completed' OR lease_end <= now())),
		min(created_at) FILTER (WHERE state = 'in_progress' AND lease_end > now()),
		now(),
		pg_total_relation_size($1::regclass),
		pg_relation_size($1::regclass)
		FROM `+s.table, s.table).Scan(&st.Completed, &st.InProgress, &st.InProgressLive, &st.Expired, &oldest, &st.Now, &st.TotalBytes, &st.TableBytes)
	if err != nil {
		return Stats{}, fmt.Errorf("idemkey postgres: stats: %w", err)
	}
	if oldest != nil {
		st.OldestLive = *oldest
	}
	rows, _ := s.pool.Query(ctx, `SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid)
		FROM pg_index i WHERE i.indrelid = $1::regclass`, s.table)
	var (
		name string
		size int64
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &size}, func() error {
		st.Indexes[name] = size
		return nil
	})
	if err != nil {
		return Stats{}, fmt.Errorf("idemkey postgres: stats: %w", err)
	}
	return st, nil
}
