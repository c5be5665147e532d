package spanner

import (
	"context"
	"fmt"
	"time"

	"cloud.google.com/go/spanner"

	"github.com/idemkey/idemkey/store"
)

// An operator's reads and deletes of the tables, for cmd/idemkey (inspect,
// forget, stats), in the shape of store/postgres's, so that the tables'
// queries have one owner. No call path of the engine uses them. Each is one
// Spanner read or one read-write transaction. Unlike the store.Store
// methods, their errors wrap the client's (with the operation named), for
// an operator's tool to describe: the store sends only hashes, so none
// quotes a key or a tenant.

// Record is one row of the store's table as an operator sees it, as
// store/postgres's Record is.
type Record struct {
	Key         store.Key
	Fingerprint []byte
	State       string // "in_progress" (no outcome yet) or "completed", as store/postgres says
	Token       int64  // the fencing token, as Reserve returned it
	Created     time.Time
	LeaseEnd    time.Time
	Expires     time.Time
	Outcome     []byte    // as stored, sealed if the engine seals; nil in progress
	Now         time.Time // Spanner's clock when the row was read
}

// adminRecord is r, the record of key read at now, as an operator sees it.
func (r record) adminRecord(key store.Key, now time.Time) Record {
	rec := Record{Key: key, Fingerprint: r.fingerprint[:], State: "in_progress", Token: int64(token(r.token, r.seq)),
		Created: r.created, LeaseEnd: r.leaseEnd, Expires: r.expires, Now: now}
	if r.completed {
		rec.State, rec.Outcome = "completed", r.outcome
	}
	return rec
}

// recordsSQL reads the records whose keys lie in [@from, @to), with
// readSQL's columns.
const recordsSQL = `SELECT CURRENT_TIMESTAMP(), key, outcome IS NOT NULL, fingerprint, token, seq, lease_end, outcome, created_at, expires_at
FROM %s WHERE key >= @from AND (@to IS NULL OR key < @to) ORDER BY key LIMIT @limit`

// Records reads at most limit records whose keys lie in [from, to) (nil: no
// bound), in the keys' byte order, the primary key's, with one strong
// read. The record of one key k is the range from k to k with a zero byte
// appended. A limit of 0 reads none, but still fails on a missing table.
// Rows past their expiry that the row deletion policy has not deleted yet
// are read too.
func (s *Store) Records(ctx context.Context, from, to []byte, limit int) ([]Record, error) {
	if from == nil {
		from = []byte{} // every key, not NULL
	}
	var recs []Record
	stmt := spanner.Statement{SQL: fmt.Sprintf(recordsSQL, s.table), Params: map[string]any{"from": from, "to": to, "limit": int64(max(limit, 0))}}
	err := s.client.Single().Query(ctx, stmt).Do(func(row *spanner.Row) error {
		now, key, r, err := scanRecord(row)
		if err != nil {
			return err
		}
		recs = append(recs, r.adminRecord(store.Key(key), now))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idemkey spanner: records: %w", err)
	}
	return recs, nil
}

// Forget deletes the record of key, and its steps, if it is completed, in
// progress under a lease that has ended, or force is true, in one
// read-write transaction that reads the record and decides, so that a call
// that reserves the key meanwhile is never deleted unseen: the key's next
// run is a new one. It returns the record as it was; a zero Record with
// deleted false means the key has no record (its steps, if any, stay).
func (s *Store) Forget(ctx context.Context, key store.Key, force bool) (rec Record, deleted bool, err error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	_, err = s.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		rec, deleted = Record{}, false // of an attempt Spanner aborted
		now, recs, err := s.readRecords(ctx, txn, key)
		if err != nil || !recs[0].found {
			return err
		}
		r := recs[0]
		rec = r.adminRecord(key, now)
		if !r.completed && r.leaseEnd.After(now) && !force {
			return nil
		}
		deleted = true
		return txn.BufferWrite([]*spanner.Mutation{
			spanner.Delete(s.table, spanner.Key{key[:]}),
			spanner.Delete(s.steps, spanner.Key{key[:]}.AsPrefix()),
		})
	})
	if err != nil {
		return Record{}, false, fmt.Errorf("idemkey spanner: forget: %w", err)
	}
	return rec, deleted, nil
}

// StepRecord is one recorded step of a key's run (store.Stepper) as an
// operator sees it, as store/postgres's is, but without the time it was
// started: the steps' table does not keep it.
type StepRecord struct {
	Name string
	// Done: the step finished, and Result holds its result. Else it was
	// started and never finished: whether it took effect is unknown.
	Done        bool
	Result      []byte            // as stored, sealed if the engine seals; nil unless Done
	Fingerprint store.Fingerprint // the request it was started for
	Expires     time.Time
	Now         time.Time // Spanner's clock when the step was read
}

// stepsSQL reads the unexpired steps of @key by name.
const stepsSQL = `SELECT name, result IS NOT NULL, result, fingerprint, expires_at, CURRENT_TIMESTAMP()
FROM %s WHERE key = @key AND expires_at > CURRENT_TIMESTAMP() ORDER BY name`

// Steps reads the steps of key that have not expired, which the key's next
// run would find, by name, with one strong read.
func (s *Store) Steps(ctx context.Context, key store.Key) ([]StepRecord, error) {
	var steps []StepRecord
	stmt := spanner.Statement{SQL: fmt.Sprintf(stepsSQL, s.steps), Params: map[string]any{"key": key[:]}}
	err := s.client.Single().Query(ctx, stmt).Do(func(row *spanner.Row) error {
		var (
			st          StepRecord
			fingerprint []byte
		)
		if err := row.Columns(&st.Name, &st.Done, &st.Result, &fingerprint, &st.Expires, &st.Now); err != nil {
			return err
		}
		copy(st.Fingerprint[:], fingerprint)
		steps = append(steps, st)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idemkey spanner: steps: %w", err)
	}
	return steps, nil
}

// Stats are the table's counts, as store/postgres's are, without the
// sizes: Spanner tells a table's size in its console and in
// SPANNER_SYS.TABLE_SIZES_STATS_1HOUR, an hour late, which the emulator
// does not have.
type Stats struct {
	Completed      int64
	InProgress     int64
	InProgressLive int64 // of InProgress, under a lease that has not ended
	// Expired rows count as absent, and wait for the row deletion policy.
	Expired int64
	// OldestLive is when the oldest record in progress under a live lease
	// was created; zero if none.
	OldestLive time.Time
	Now        time.Time // Spanner's clock
}

// statsSQL counts the records of the table in one scan.
const statsSQL = `SELECT CURRENT_TIMESTAMP(),
	COUNTIF(outcome IS NOT NULL),
	COUNTIF(outcome IS NULL),
	COUNTIF(outcome IS NULL AND lease_end > CURRENT_TIMESTAMP()),
	COUNTIF(expires_at <= CURRENT_TIMESTAMP() AND (outcome IS NOT NULL OR lease_end <= CURRENT_TIMESTAMP())),
	MIN(IF(outcome IS NULL AND lease_end > CURRENT_TIMESTAMP(), created_at, NULL))
FROM %s`

// Stats counts the table's records by state with one strong read, a scan
// of the table.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	var (
		st     Stats
		oldest spanner.NullTime
	)
	err := s.client.Single().Query(ctx, spanner.Statement{SQL: fmt.Sprintf(statsSQL, s.table)}).Do(func(row *spanner.Row) error {
		return row.Columns(&st.Now, &st.Completed, &st.InProgress, &st.InProgressLive, &st.Expired, &oldest)
	})
	if err != nil {
		return Stats{}, fmt.Errorf("idemkey spanner: stats: %w", err)
	}
	st.OldestLive = oldest.Time
	return st, nil
}
