package postgres

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey/store"
)

// Recorded steps (store.Stepper) live in the table "<table>_steps"
// (migration 003), one row per key and step name, and leases are renewed
// (store.Renewer) on the records' table. Each method is one statement, in
// one round trip, on a connection of the pool, never in an atomic call's
// transaction: a step's record must outlive the rollback of the handler's
// writes.
//
// The fence of a non-zero token is the test Complete makes (held), in the
// statement that writes: a CTE reads the record FOR SHARE, so that a
// takeover committed after the statement's snapshot is seen (READ COMMITTED
// reads the newest version of a row it locks) and one that comes later waits
// for the step's write. Token 0, an open atomic transaction's run, writes
// with no fence: its key has no record until it commits.

// fenceSQL is the CTE fence: the expiry of the record of key $1 that token
// $2 holds in progress, locked until the statement's write commits; or its
// lease's end, if later (a run still held past the retention), so that its
// steps outlive it, as store/memory's do.
func fenceSQL(table string) string {
	return fmt.Sprintf(`fence AS (SELECT greatest(expires_at, lease_end) AS expires_at FROM %s WHERE %s FOR SHARE)`, table, held)
}

// fenced is the condition under which a step statement writes.
const fenced = `($2 = 0 OR EXISTS (SELECT FROM fence))`

// startStepSQL makes StartStep's decision in one statement. cur reads the
// step's unexpired row, which answers as it is; only without one does ins
// write, with the expiry life gives: the record's, or, for token 0, the
// retention from now. A conflicting row that ins finds is replaced only if
// it has expired. When ins wrote nothing although cur found no row, a row
// was committed after this statement's snapshot, and the statement answers
// no row: StartStep runs it again with a new snapshot, which finds it.
//
// Parameters: key, token, name, fingerprint, retention in microseconds.
// Result columns: kind (0 lease lost, 1 new, 2 started, 3 done),
// fingerprint, result.
func startStepSQL(table, steps string) string {
	return fmt.Sprintf(`
WITH %[3]s, life AS (
	SELECT now() + $5 * interval '1 microsecond' AS expires_at WHERE $2 = 0
	UNION ALL
	SELECT expires_at FROM fence
), cur AS (
	SELECT c.fingerprint, c.result FROM %[2]s AS c WHERE c.key = $1 AND c.name = $3 AND c.expires_at > now()
), ins AS (
	INSERT INTO %[2]s AS s (key, name, fingerprint, result, started_at, expires_at)
	SELECT $1, $3, $4, NULL, now(), l.expires_at FROM life AS l
	WHERE NOT EXISTS (SELECT FROM cur)
	ON CONFLICT (key, name) DO UPDATE SET
		fingerprint = excluded.fingerprint,
		result = NULL,
		started_at = excluded.started_at,
		expires_at = excluded.expires_at
	WHERE s.expires_at <= now()
	RETURNING 1
)
SELECT 1, NULL::bytea, NULL::bytea FROM ins
UNION ALL
SELECT CASE WHEN c.result IS NULL THEN 2 ELSE 3 END, c.fingerprint, c.result FROM cur AS c WHERE EXISTS (SELECT FROM life)
UNION ALL
SELECT 0, NULL, NULL WHERE NOT EXISTS (SELECT FROM life)`, table, steps, fenceSQL(table))
}

// finishStepSQL records the result ($4) of the step named $3, started or
// done, that has not expired: a retry writes the same again. It answers a
// row per row written, for RowsAffected.
func finishStepSQL(table, steps string) string {
	return fmt.Sprintf(`WITH %s
UPDATE %s SET result = $4 WHERE key = $1 AND name = $3 AND expires_at > now() AND %s`, fenceSQL(table), steps, fenced)
}

// forgetStepsSQL deletes the steps named in $3 of key $1, or all of them if
// $3 is empty, and answers one row if the fence let it.
func forgetStepsSQL(table, steps string) string {
	return fmt.Sprintf(`WITH %[1]s, gone AS (
	DELETE FROM %[2]s WHERE key = $1 AND (coalesce(cardinality($3::text[]), 0) = 0 OR name = ANY ($3::text[])) AND %[3]s
)
SELECT WHERE %[3]s`, fenceSQL(table), steps, fenced)
}

const (
	// renewSQL ends the lease of the record that token $2 holds in progress
	// $3 microseconds from now.
	renewSQL = `UPDATE %s SET lease_end = now() + $3 * interval '1 microsecond' WHERE %s`

	// sweepStepsSQL deletes one batch of expired steps, as sweepSQL does
	// records.
	sweepStepsSQL = `DELETE FROM %[1]s WHERE (key, name) IN (
	SELECT key, name FROM %[1]s WHERE expires_at <= now()
	LIMIT $1
	FOR UPDATE SKIP LOCKED)`
)

// StartStep implements store.Stepper in one round trip (startStepSQL); a row
// changed under the statement, or a dead connection, runs it again. A start
// that took effect unseen then finds the step started: its outcome is
// unknown to the run, which never runs it blind.
func (s *Store) StartStep(ctx context.Context, st store.StepStart) (store.StepEntry, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	retention := max(st.Retention, 0).Microseconds()
	var (
		kind        int
		fingerprint []byte
		res         store.StepEntry
		err         error
	)
	for range maxAttempts {
		err = s.pool.QueryRow(ctx, s.startStepSQL, st.Key[:], int64(st.Token), st.Name, st.Fingerprint[:], retention).
			Scan(&kind, &fingerprint, &res.Result)
		if !errors.Is(err, pgx.ErrNoRows) && !serializationFailure(err) && !reconnect(err) {
			break
		}
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows) || serializationFailure(err):
		return store.StepEntry{}, fmt.Errorf("idemkey postgres: start step %q: %w: the step changed under %d attempts in a row", st.Name, store.ErrUnavailable, maxAttempts)
	case err != nil:
		return store.StepEntry{}, s.translate(ctx, "start step", err)
	}
	switch kind {
	case 0:
		return store.StepEntry{}, fmt.Errorf("idemkey postgres: start step %q: %w", st.Name, store.ErrLeaseLost)
	case 1:
		return store.StepEntry{State: store.StepNew}, nil
	case 2:
		res.State = store.StepStarted
	default:
		res.State = store.StepDone
	}
	copy(res.Fingerprint[:], fingerprint)
	return res, nil
}

// FinishStep implements store.Stepper, detached from ctx like Complete, and
// run again on a fresh connection as Complete is: the effect it records has
// happened. A retry that the fence refuses returns store.ErrLeaseLost,
// though the lost attempt may have recorded the result.
func (s *Store) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	if result == nil {
		result = []byte{} // pgx sends a nil slice as NULL, which means "started"
	}
	return s.write(ctx, "finish step", s.finishStepSQL, key, token, name, result)
}

// ForgetSteps implements store.Stepper, detached from ctx like Complete.
func (s *Store) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	if names == nil {
		names = []string{}
	}
	return s.write(ctx, "forget steps", s.forgetStepsSQL, key, token, names)
}

// Renew implements store.Renewer, detached from ctx like Complete, so that
// a renewal on a dead connection is made again on a fresh one.
func (s *Store) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	return s.write(ctx, "renew", s.renewSQL, key, token, max(lease, 0).Microseconds())
}
