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
// forget, resolve-step, stats, migrate down), so that the table's SQL has one owner and a
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

// Forget deletes the record of key, and its steps, if it is completed, in
// progress under a lease that has ended, or force is true, in one statement
// that decides whether it may, so that a call that reserves the key
// meanwhile is never deleted unseen: the key's next run is a new one. It
// returns the record as it was; a zero Record with deleted false means the
// key has no record (its steps, if any, stay: ResolveStep tells them).
func (s *Store) Forget(ctx context.Context, key store.Key, force bool) (rec Record, deleted bool, err error) {
	for range 3 {
		rec, err = scanRecord(s.pool.QueryRow(ctx, `WITH rec AS (DELETE FROM `+s.table+`
			WHERE key = $1 AND (state = 'completed' OR lease_end <= now() OR $2)
			RETURNING `+recordColumns+`), steps AS (DELETE FROM `+s.steps+` WHERE key = $1 AND EXISTS (SELECT FROM rec))
			SELECT * FROM rec`, key[:], force))
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

// Step is one recorded step of a key's run (store.Stepper) as an operator
// sees it.
type Step struct {
	Name string
	// Done: the step finished, and Result holds its result. Else it was
	// started and never finished: whether it took effect is unknown.
	Done        bool
	Result      []byte            // as stored, sealed if the engine seals; nil unless Done
	Fingerprint store.Fingerprint // the request it was started for
	Started     time.Time
	Expires     time.Time
	Now         time.Time // the database's clock when the step was read
}

// Steps reads the steps of key that have not expired, which the key's next
// run would find, by name.
func (s *Store) Steps(ctx context.Context, key store.Key) ([]Step, error) {
	rows, _ := s.pool.Query(ctx, `SELECT name, result IS NOT NULL, result, fingerprint, started_at, expires_at, now()
		FROM `+s.steps+` WHERE key = $1 AND expires_at > now() ORDER BY name`, key[:])
	steps, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Step, error) {
		var (
			st          Step
			fingerprint []byte
		)
		err := row.Scan(&st.Name, &st.Done, &st.Result, &fingerprint, &st.Started, &st.Expires, &st.Now)
		copy(st.Fingerprint[:], fingerprint)
		return st, err
	})
	if err != nil {
		return nil, fmt.Errorf("idemkey postgres: steps: %w", err)
	}
	return steps, nil
}

// ResolveStep tells the outcome of the step name of key that was started and
// never finished, for a run that found it so to go on: done records result as
// its result, as the run's FinishStep would have; not done deletes it, so
// that the key's next run runs it. One statement decides whether it may, so
// that a step finished meanwhile is never overwritten unseen. found is false
// if key has no such unexpired step. It refuses, with found true and an
// error that says why, a step that is finished (left as it is), and one of
// a key in progress under a live lease, whose run may be running it now.
func (s *Store) ResolveStep(ctx context.Context, key store.Key, name string, done bool, result []byte) (found bool, err error) {
	write, args := `DELETE FROM `+s.steps+` WHERE`, []any{key[:], name}
	if done {
		if result == nil {
			result = []byte{} // not NULL, which means "started"
		}
		write, args = `UPDATE `+s.steps+` SET result = $3 WHERE`, append(args, result)
	}
	sql := `WITH cur AS (
	SELECT result IS NOT NULL AS done FROM ` + s.steps + ` WHERE key = $1 AND name = $2 AND expires_at > now()
), live AS (
	SELECT lease_end FROM ` + s.table + ` WHERE key = $1 AND state = 'in_progress' AND lease_end > now()
), w AS (
	` + write + ` key = $1 AND name = $2 AND result IS NULL AND expires_at > now() AND NOT EXISTS (SELECT FROM live)
	RETURNING 1
)
SELECT (SELECT done FROM cur), (SELECT lease_end FROM live), now(), EXISTS (SELECT FROM w)`
	for range 3 {
		var (
			finished *bool
			leaseEnd *time.Time
			now      time.Time
			wrote    bool
		)
		if err := s.pool.QueryRow(ctx, sql, args...).Scan(&finished, &leaseEnd, &now, &wrote); err != nil {
			return false, fmt.Errorf("idemkey postgres: resolve step: %w", err)
		}
		switch {
		case wrote:
			return true, nil
		case finished == nil:
			return false, nil
		case *finished:
			return true, fmt.Errorf("idemkey postgres: resolve step: step %q is finished already: left as it is", name)
		case leaseEnd != nil:
			return true, fmt.Errorf("idemkey postgres: resolve step: the key is in progress under a live lease, which ends in %s: its run may be running step %q now; wait for the lease to end",
				leaseEnd.Sub(now).Round(time.Second), name)
		}
		// Started, and not live, in the statement's snapshot, but changed
		// after it: decide again.
	}
	return true, fmt.Errorf("idemkey postgres: resolve step: step %q kept changing: try again", name)
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
