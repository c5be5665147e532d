package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

// DefaultTable is the table the migrations create and the store uses.
const DefaultTable = "idempotency_keys"

const defaultTimeout = 5 * time.Second

// maxAttempts bounds how often a statement runs again when the row changed
// under it: "conflict, then the row is gone" in Reserve, or a serialization
// failure. Each retry needs another concurrent change of the same key to fail
// again, so more than a few in a row means a pathological storm.
const maxAttempts = 10

// Option configures a Store and Migrate.
type Option func(*options)

type options struct {
	name        string // as WithTable was given it
	schema      string // "" means the first schema on the search_path
	table       string
	logger      *slog.Logger
	timeout     time.Duration
	atomicConns int32   // 0: the default share of the pool
	unchecked   bool    // WithoutSchemaCheck
	sweepShare  float64 // WithSweepShare
}

// WithTable names the table: "name", or "schema.name" for a schema other than
// the first on the search_path. Each part is a lower-case SQL identifier
// (letters, digits, underscores) of at most 48 bytes, so that the names
// derived from it (the token sequence, the steps' table, their indexes) fit PostgreSQL's
// 63-byte limit. Pass the same option to Migrate and New.
func WithTable(name string) Option {
	return func(o *options) { o.name = name }
}

// WithLogger sets where the store logs: migrations at Info, the driver's
// error behind each it translates at Debug. Nil, the default, discards.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// WithTimeout bounds each operation (five seconds if d <= 0); Complete and
// Release ignore the caller's cancellation and use only this bound.
func WithTimeout(d time.Duration) Option {
	return func(o *options) { o.timeout = d }
}

// WithAtomicConns bounds how many atomic calls run at once, each holding a
// pool connection for its handler's whole run, so that reservations,
// replays and records never queue behind running handlers. The default is
// three quarters of the pool's MaxConns; n is kept below MaxConns.
func WithAtomicConns(n int) Option {
	return func(o *options) { o.atomicConns = int32(min(max(n, 0), math.MaxInt32)) }
}

// WithoutSchemaCheck makes New skip its query of the database, for a server
// that must start while its database is down: a missing table then shows at
// the first call, which fails closed with an Error log that names the fix.
func WithoutSchemaCheck() Option {
	return func(o *options) { o.unchecked = true }
}

// WithSweepShare paces Sweep: after each batch it rests so that its
// statements take at most share of its time, 0.01 <= share <= 1. At 0.05, a
// batch that took 20 ms is followed by 380 ms of rest, so the sweeper holds
// one backend at most a twentieth of the time however many rows expire at
// once; an hour's expired keys of a month-long retention are then swept in
// about twenty times their statements' time (BENCHMARKS.md has the figures).
// The default, 1, never rests.
func WithSweepShare(share float64) Option {
	return func(o *options) { o.sweepShare = share }
}

var tableName = regexp.MustCompile(`^([a-z_][a-z0-9_]{0,47}\.)?[a-z_][a-z0-9_]{0,47}$`)

func newOptions(opts []Option) (options, error) {
	o := options{name: DefaultTable, timeout: defaultTimeout, sweepShare: 1}
	for _, opt := range opts {
		opt(&o)
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	if o.timeout <= 0 {
		o.timeout = defaultTimeout
	}
	if !(o.sweepShare >= 0.01 && o.sweepShare <= 1) { // NaN too
		return o, fmt.Errorf("idemkey postgres: sweep share %v: want 0.01 to 1", o.sweepShare)
	}
	if !tableName.MatchString(o.name) {
		return o, fmt.Errorf("idemkey postgres: table name %q: want name or schema.name, each a lower-case SQL identifier of at most 48 bytes", o.name)
	}
	o.table = o.name
	if schema, table, ok := strings.Cut(o.name, "."); ok {
		o.schema, o.table = schema, table
	}
	return o, nil
}

// qualified returns name in the table's schema, ready for SQL text: name is
// an identifier derived from the table name, checked by newOptions.
func (o options) qualified(name string) string {
	if o.schema == "" {
		return name
	}
	return o.schema + "." + name
}

// Store is a store.Store on a PostgreSQL table. Every decision about time
// uses the database's clock. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
	opts options

	insertSQL, reserveSQL, findSQL, completeSQL, releaseSQL string
	markSQL                                                 string // insertSQL of a store that runs Listen
	notifySQL                                               string // a notification on the table's channel (watch.go)
	insertBatchSQL                                          string // two-phase batches' (reservebatch.go)
	sweepSQL, sweepStepsSQL                                 string
	startStepSQL, finishStepSQL, forgetStepsSQL, renewSQL   string // steps.go
	steps                                                   string // the steps' table's name in SQL text
	confirmSQL                                              string
	lookupSQL                                               string        // lookup.go
	outbox                                                  string        // the outbox's table's name in SQL text (outbox.go)
	writeMessagesSQL, claimSQL, markSentSQL                 string        // outbox.go
	retryMessagesSQL, sweepSentSQL, pendingSQL              string        // outbox.go
	probeSQL, lockSQL, readSQL, recordSQL, takeoverSQL      string        // atomic mode's
	holdersSQL                                              string        // atomic mode's, for keys found busy
	batchProbeSQL, batchProbeAloneSQL, batchRecordSQL       string        // atomic batches' (batch.go)
	table                                                   string        // its name in SQL text
	watch                                                   watch         // what Watch decides from (watch.go)
	slots                                                   chan struct{} // one per running atomic transaction
	lent                                                    atomic.Int64  // calls waiting for a slot in a transaction (claim)
	lendable                                                int64         // the most of them
	probed                                                  atomic.Int64  // calls that ran the probe on its own, for the tests
}

var (
	_ store.Store   = (*Store)(nil)
	_ store.Finder  = (*Store)(nil)
	_ store.Watcher = (*Store)(nil)
	_ store.Stepper = (*Store)(nil)
	_ store.Renewer = (*Store)(nil)
)

// New returns a store on pool, after checking once that its table has every
// migration of this idemkey (a newer idemkey's are accepted with a warning):
// it fails at start-up, naming the fix, rather than at the first call. A
// database that cannot be reached within WithTimeout fails it with
// store.ErrUnavailable. New starts no goroutine.
func New(pool *pgxpool.Pool, opts ...Option) (*Store, error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	if pool == nil {
		return nil, errors.New("idemkey postgres: New needs a pool, not nil")
	}
	if hosts, primaryOnly := failoverHosts(pool.Config().ConnConfig); hosts > 1 && !primaryOnly {
		o.logger.LogAttrs(context.Background(), slog.LevelWarn, "idemkey postgres: the database URL names "+strconv.Itoa(hosts)+
			" hosts without target_session_attrs=read-write (or primary): connections may go to a standby, where every reservation and record fails until it is promoted")
	}
	table, steps, outbox := o.qualified(o.table), o.qualified(o.table+"_steps"), o.qualified(o.table+"_outbox")
	slots := atomicConns(pool.Config().MaxConns, o.atomicConns)
	s := &Store{
		pool:        pool,
		opts:        o,
		table:       table,
		insertSQL:   insertSQL(table, o.qualified(o.table+"_token_seq"), false),
		markSQL:     insertSQL(table, o.qualified(o.table+"_token_seq"), true),
		notifySQL:   "SELECT pg_notify(" + channelSQL(table) + ", $1)",
		reserveSQL:  reserveSQL(table, o.qualified(o.table+"_token_seq")),
		findSQL:     fmt.Sprintf(findSQL, table),
		completeSQL: completeSQL(table),
		confirmSQL:  fmt.Sprintf(confirmSQL, table),
		releaseSQL:  releaseSQL(table),
		sweepSQL:    fmt.Sprintf(sweepSQL, table),
		steps:       steps,
		probeSQL:    probeSQL(table),
		lockSQL:     lockSQL(table),
		readSQL:     readSQL(table),
		recordSQL:   fmt.Sprintf(recordSQL, table),
		takeoverSQL: takeoverSQL(table),
		holdersSQL:  holdersSQL(table),
		slots:       make(chan struct{}, slots),
		lendable:    lendable(pool.Config().MaxConns, slots),

		insertBatchSQL:     insertBatchSQL(table, o.qualified(o.table+"_token_seq")),
		batchProbeSQL:      batchProbeSQL(table, false),
		batchProbeAloneSQL: batchProbeSQL(table, true),
		batchRecordSQL:     fmt.Sprintf(batchRecordSQL, table),

		startStepSQL:   startStepSQL(table, steps),
		finishStepSQL:  finishStepSQL(table, steps),
		forgetStepsSQL: forgetStepsSQL(table, steps),
		renewSQL:       fmt.Sprintf(renewSQL, table, held),
		sweepStepsSQL:  fmt.Sprintf(sweepStepsSQL, steps),
		lookupSQL:      lookupSQL(table, steps),

		outbox:           outbox,
		writeMessagesSQL: writeMessagesSQL(outbox),
		claimSQL:         claimSQL(outbox),
		markSentSQL:      fmt.Sprintf(markSentSQL, outbox),
		retryMessagesSQL: fmt.Sprintf(retryMessagesSQL, outbox),
		sweepSentSQL:     fmt.Sprintf(sweepSentSQL, outbox),
		pendingSQL:       fmt.Sprintf(pendingSQL, outbox),
	}
	if !o.unchecked {
		ms, err := readMigrations()
		if err != nil {
			return nil, fmt.Errorf("idemkey postgres: migrations: %w", err)
		}
		if err := s.checkSchema(ms); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// atomicConns is how many of a pool of size connections atomic transactions
// may hold: n if set, else three quarters; always at least one, and at least
// one fewer than size where size allows.
func atomicConns(size, n int32) int {
	if n == 0 {
		n = size - size/4
	}
	return int(max(min(n, size-1), 1))
}

// takeable is the condition under which a reservation may take over the row
// named r: it has expired (its retention has passed and it holds no live
// lease), or its lease has ended while the same request ($2) held it.
func takeable(r string) string { return takeableBy(r, "$2") }

// takeableBy is takeable for the request whose fingerprint is the SQL
// expression fingerprint.
func takeableBy(r, fingerprint string) string {
	return fmt.Sprintf(`(%[1]s.state = 'completed' AND %[1]s.expires_at <= now())
		OR (%[1]s.state = 'in_progress' AND %[1]s.lease_end <= now()
			AND (%[1]s.fingerprint = %[2]s OR %[1]s.expires_at <= now()))`, r, fingerprint)
}

// reserveSQL makes the reservation's decision in one statement. cur reads the
// row; only when there is none, or it may be taken over, does ins try to
// write, so a replay locks no row and writes nothing.
// The unique key settles races: on a conflict, ins takes the row over only if
// its newest version is still takeable. When ins wrote nothing although cur
// allowed it, the row changed after this statement's snapshot, and the
// statement returns no row: Reserve runs it again with a new snapshot.
//
// Parameters: key, fingerprint, lease and retention in microseconds. Result
// columns: kind (1 acquired, 2 completed, 3 in progress), token, fingerprint,
// outcome, time left on the lease, the record's expiry.
func reserveSQL(table, sequence string) string {
	return fmt.Sprintf(`
WITH cur AS (
	SELECT c.state, c.fingerprint, c.outcome, c.lease_end, c.expires_at, %[3]s AS takeable
	FROM %[1]s AS c WHERE c.key = $1
), ins AS (
	INSERT INTO %[1]s AS r (key, fingerprint, state, token, lease_end, created_at, expires_at)
	SELECT $1, $2, 'in_progress', nextval('%[2]s'),
		now() + $3 * interval '1 microsecond', now(), now() + $4 * interval '1 microsecond'
	WHERE NOT EXISTS (SELECT FROM cur WHERE NOT takeable)
	ON CONFLICT (key) DO UPDATE SET
		fingerprint = excluded.fingerprint,
		state = 'in_progress',
		token = excluded.token,
		lease_end = excluded.lease_end,
		outcome = NULL,
		created_at = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
		expires_at = CASE WHEN r.expires_at <= now() THEN excluded.expires_at ELSE r.expires_at END,
		waited = false
	WHERE %[4]s
	RETURNING r.token, r.expires_at
)
SELECT 1, token, NULL::bytea, NULL::bytea, NULL::interval, expires_at FROM ins
UNION ALL
SELECT CASE state WHEN 'completed' THEN 2 ELSE 3 END, 0, fingerprint, outcome, lease_end - now(), expires_at
FROM cur WHERE NOT takeable`, table, sequence, takeable("c"), takeable("r"))
}

// insertSQL is the reservation of a key with no record, which is most of
// them, in one plain insert; it answers like reserveSQL. When the key has a
// record, the insert does nothing and locks nothing, and the record answers
// from the statement's snapshot: a replay, or "in progress". Only a record
// that may be taken over answers kind 4, for which Reserve runs
// reserveSQL. A record committed after the snapshot but before the insert
// answers no row, and Reserve runs the statement again, as it does
// reserveSQL's.
//
// On a store that runs Listen, a record in progress whose lease runs, of
// the same request (a different one is answered "reused" and waits for
// nothing), and that no duplicate marked waited answers kind 5, for which Reserve runs
// the statement again with mark: then it marks the record waited, so that
// its Complete or Release notifies (completeSQL), and answers kind 3. So
// only the first duplicate of a run writes, and only it pays a second
// round trip; a new key pays nothing for it. A record that changed since
// the snapshot, so that the mark finds it no longer in progress, answers
// no row as above, and the statement runs again: a duplicate is never told
// "in progress" of a record whose notification it would not hear.
//
// Parameters and result columns as reserveSQL's.
func insertSQL(table, sequence string, mark bool) string {
	marked, held, unmarked := "", "", "WHEN NOT c.waited AND c.lease_end > now() AND c.fingerprint = $2 THEN 5 "
	if mark {
		marked = fmt.Sprintf(`, mark AS (
	UPDATE %[1]s AS m SET waited = true
	WHERE m.key = $1 AND m.state = 'in_progress' AND NOT m.waited AND m.lease_end > now() AND m.fingerprint = $2
		AND NOT EXISTS (SELECT FROM ins)
	RETURNING 1
)`, table)
		held = ` AND (c.state = 'completed' OR c.waited OR c.lease_end <= now() OR c.fingerprint <> $2 OR EXISTS (SELECT FROM mark))`
		unmarked = ""
	}
	return fmt.Sprintf(`
WITH ins AS (
	INSERT INTO %[1]s (key, fingerprint, state, token, lease_end, created_at, expires_at)
	VALUES ($1, $2, 'in_progress', nextval('%[2]s'),
		now() + $3 * interval '1 microsecond', now(), now() + $4 * interval '1 microsecond')
	ON CONFLICT (key) DO NOTHING
	RETURNING token, expires_at
)%[4]s
SELECT 1, token, NULL::bytea, NULL::bytea, NULL::interval, expires_at FROM ins
UNION ALL
SELECT CASE WHEN %[3]s THEN 4 WHEN c.state = 'completed' THEN 2 %[6]sELSE 3 END, 0, c.fingerprint, c.outcome, c.lease_end - now(), c.expires_at
FROM %[1]s AS c WHERE c.key = $1 AND NOT EXISTS (SELECT FROM ins)%[5]s`, table, sequence, takeable("c"), marked, held, unmarked)
}

// scanReservation reads the row of reserveSQL.
func scanReservation(row pgx.Row) (store.Entry, error) {
	var (
		kind        int
		res         store.Entry
		fingerprint []byte
		leaseLeft   pgtype.Interval
	)
	if err := row.Scan(&kind, &res.Token, &fingerprint, &res.Outcome, &leaseLeft, &res.Expires); err != nil {
		return store.Entry{}, err
	}
	switch kind {
	case 1:
		res.State = store.Acquired
	case 4:
		return store.Entry{}, errTakeable
	case 5:
		res.State, res.RetryAfter = store.Held, intervalDuration(leaseLeft)
		copy(res.Fingerprint[:], fingerprint)
		return res, errUnmarked
	case 0:
		return store.Entry{}, errChanged
	case 2:
		res.State = store.Completed
	default:
		res.State, res.RetryAfter = store.Held, intervalDuration(leaseLeft)
	}
	copy(res.Fingerprint[:], fingerprint)
	return res, nil
}

// intervalDuration is a lease's time left, saturated, and 0 if it has passed.
func intervalDuration(left pgtype.Interval) time.Duration {
	micros := min(float64(left.Microseconds)+float64(left.Days)*24*3600e6, math.MaxInt64/1e3)
	return max(time.Duration(micros)*time.Microsecond, 0)
}

// findSQL reads a completed record that has not expired: the row that
// reserveSQL would answer with kind 2. A record has an outcome exactly when
// it is completed (the table's CHECK), and testing for NULL costs less than
// comparing text, on the path of every replay.
const findSQL = `SELECT fingerprint, outcome, expires_at FROM %s WHERE key = $1 AND outcome IS NOT NULL AND expires_at > now()`

// held matches the in-progress row held by token $2 that has not expired.
const held = `key = $1 AND token = $2 AND state = 'in_progress' AND (lease_end > now() OR expires_at > now())`

// confirmSQL reads whether the row of key held by token $2 is completed.
const confirmSQL = `SELECT state = 'completed' FROM %s WHERE key = $1 AND token = $2`

// completeSQL and releaseSQL write the row held by token $2 and, if a
// duplicate marked it waited (insertSQL), notify the table's channel
// (channelSQL) of the key ($1, in hex) in the same statement, which
// PostgreSQL delivers once it commits. Both answer a row per row written,
// for RowsAffected. A notification costs each commit that sends one a lock
// that orders such commits (PostgreSQL's notification queue), so a record
// no duplicate waited for sends none.
func completeSQL(table string) string {
	return fmt.Sprintf(`WITH w AS (UPDATE %s SET state = 'completed', outcome = $3 WHERE %s RETURNING waited)
SELECT CASE WHEN waited THEN pg_notify(%s, encode($1, 'hex')) END FROM w`, table, held, channelSQL(table))
}

func releaseSQL(table string) string {
	return fmt.Sprintf(`WITH w AS (DELETE FROM %s WHERE %s RETURNING waited)
SELECT CASE WHEN waited THEN pg_notify(%s, encode($1, 'hex')) END FROM w`, table, held, channelSQL(table))
}

const (
	// sweepSQL deletes one batch of expired rows. SKIP LOCKED passes over rows
	// that a reservation is taking over right now, so sweeping never waits on
	// live traffic; a reservation of a row being swept waits for at most one
	// batch's statement.
	sweepSQL = `DELETE FROM %[1]s WHERE key IN (
	SELECT key FROM %[1]s
	WHERE expires_at <= now() AND (state = 'completed' OR lease_end <= now())
	LIMIT $1
	FOR UPDATE SKIP LOCKED)`
)

// failoverHosts counts the distinct servers a connection may go to (a
// multi-host URL, for a primary and its standbys), and reports whether a
// connection is checked to be writable (target_session_attrs=read-write or
// primary) or checked at all by a ValidateConnect of the user's own.
func failoverHosts(cfg *pgx.ConnConfig) (hosts int, primaryOnly bool) {
	seen := map[string]bool{net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))): true}
	for _, fb := range cfg.Fallbacks {
		seen[net.JoinHostPort(fb.Host, strconv.Itoa(int(fb.Port)))] = true
	}
	return len(seen), cfg.ValidateConnect != nil
}

// errTakeable is insertSQL's answer for a record that may be taken over.
var errTakeable = errors.New("idemkey postgres: the record may be taken over")

// errUnmarked is insertSQL's answer, with its entry, for a record in
// progress that no duplicate marked waited.
var errUnmarked = errors.New("idemkey postgres: the record in progress is not marked waited")

// errChanged is insertBatchSQL's answer for a key whose record changed
// under the statement.
var errChanged = errors.New("idemkey postgres: the record changed under the statement")

// Reserve implements store.Store in one round trip (insertSQL), a second for
// a takeover (reserveSQL) or a first duplicate's mark; a row changed under
// the statement, or a dead connection, runs it again: a reservation that
// took effect unseen then finds the key in progress, never runs it twice.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	lease, retention := max(r.Lease, 0).Microseconds(), max(r.Retention, 0).Microseconds()
	var (
		res store.Entry
		err error
	)
	for range maxAttempts {
		sql, listening, since := s.insertSQL, s.watch.listening.Load(), s.watch.heard.Load()
		switch {
		case errors.Is(err, errTakeable):
			sql = s.reserveSQL
		case errors.Is(err, errUnmarked):
			sql = s.markSQL
		}
		res, err = scanReservation(s.pool.QueryRow(ctx, sql, r.Key[:], r.Fingerprint[:], lease, retention))
		switch {
		case errors.Is(err, errUnmarked) && listening:
			continue // mark it, so that its record notifies
		case errors.Is(err, errUnmarked):
			return res, nil
		case err == nil && listening && res.State == store.Held && sql == s.reserveSQL:
			// reserveSQL marks nothing: a record that another call took
			// over since insertSQL's snapshot is marked as insertSQL's.
			err = errUnmarked
			continue
		case err == nil && listening && res.State == store.Acquired:
			s.watch.holds(r.Key, r.Lease, since, acquired)
			return res, nil
		case err == nil && listening && res.State == store.Held:
			s.watch.holds(r.Key, res.RetryAfter, since, heldSilent)
			return res, nil
		case err == nil:
			return res, nil
		case errors.Is(err, errTakeable):
			continue
		case errors.Is(err, pgx.ErrNoRows) || serializationFailure(err) || reconnect(err):
			continue
		}
		break
	}
	if errors.Is(err, errUnmarked) {
		return res, nil // held, unmarked: the duplicate polls
	}
	if errors.Is(err, pgx.ErrNoRows) || serializationFailure(err) {
		return store.Entry{}, fmt.Errorf("idemkey postgres: reserve: %w: the row changed under %d attempts in a row", store.ErrUnavailable, maxAttempts)
	}
	return store.Entry{}, s.translate(ctx, "reserve", err)
}

// Find implements store.Finder with one plain SELECT by key, run again after
// a serialization failure or on a fresh connection (reconnect).
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	res := store.Entry{State: store.Completed}
	var fingerprint []byte
	err := s.pool.QueryRow(ctx, s.findSQL, key[:]).Scan(&fingerprint, &res.Outcome, &res.Expires)
	for attempt := 1; attempt < maxAttempts && (serializationFailure(err) || reconnect(err)); attempt++ {
		err = s.pool.QueryRow(ctx, s.findSQL, key[:]).Scan(&fingerprint, &res.Outcome, &res.Expires)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return store.Entry{}, false, nil
	}
	if err != nil {
		return store.Entry{}, false, s.translate(ctx, "find", err)
	}
	copy(res.Fingerprint[:], fingerprint)
	return res, true, nil
}

// Complete implements store.Store, bounded by the store's timeout rather than
// ctx: a caller that hangs up must not leave its key in progress.
func (s *Store) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	if outcome == nil {
		outcome = []byte{} // pgx sends a nil slice as NULL, which means "in progress"
	}
	defer s.watch.forget(key)
	return s.write(ctx, "complete", s.completeSQL, key, token, outcome)
}

// Release implements store.Store, detached from ctx like Complete.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	defer s.watch.forget(key)
	return s.write(ctx, "release", s.releaseSQL, key, token)
}

// write runs Complete's or Release's statement on the row of key held by
// token. Both are fenced by the token, so a write whose connection died (a
// terminated backend, a restart, a failover) runs again on a fresh
// connection until the store's timeout. If the dead connection may have
// carried it out already, a retry that matches no row asks whether it did:
// the row completed under token, or gone from token.
func (s *Store) write(ctx context.Context, op, sql string, key store.Key, token store.Token, args ...any) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	args = append([]any{key[:], int64(token)}, args...)
	unsure := false // an earlier attempt may have taken effect
	for attempt, wait := 1, retryPause; ; attempt++ {
		tag, err := s.pool.Exec(ctx, sql, args...)
		switch {
		case err == nil && tag.RowsAffected() == 0 && unsure:
			return s.confirm(ctx, op, key, token)
		case err == nil && tag.RowsAffected() == 0:
			return fmt.Errorf("idemkey postgres: %s: %w", op, store.ErrLeaseLost)
		case err == nil:
			return nil
		case serializationFailure(err) && attempt < maxAttempts:
			continue
		case connectionLost(err) && store.Pause(ctx, wait):
			unsure = unsure || !pgconn.SafeToRetry(err)
			wait = min(2*wait, maxRetryPause)
			continue
		}
		return s.translate(ctx, op, err)
	}
}

// confirm decides a write retried after its first attempt's fate was lost
// with its connection: done if the row of key is completed under token (for
// Complete) or no longer held by token (for Release), else ErrLeaseLost.
// The other writes (steps.go) write the same again when they run again, so
// a retry that matches no row means the token no longer holds the key.
func (s *Store) confirm(ctx context.Context, op string, key store.Key, token store.Token) error {
	if op != "complete" && op != "release" {
		return fmt.Errorf("idemkey postgres: %s: %w", op, store.ErrLeaseLost)
	}
	var completed bool
	err := s.pool.QueryRow(ctx, s.confirmSQL, key[:], int64(token)).Scan(&completed)
	switch {
	case op == "release" && errors.Is(err, pgx.ErrNoRows):
		return nil
	case err == nil && op == "complete" && completed:
		return nil
	case err == nil || errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("idemkey postgres: %s: %w", op, store.ErrLeaseLost)
	}
	return s.translate(ctx, op, err)
}

// Pauses between the attempts of a statement whose connection was lost: the
// pool's other idle connections may have died with it, and a restarting
// server takes a moment.
const (
	retryPause    = 10 * time.Millisecond
	maxRetryPause = 250 * time.Millisecond
)

// reconnect reports whether a read or a reservation that failed with err
// should run again on a fresh connection: its own connection died
// (connectionLost), but the database was reachable when it was made. When no
// new connection can be made, the caller hears so at once, so that the client
// retries with its own backoff rather than wait out its deadline here.
func reconnect(err error) bool {
	var connectErr *pgconn.ConnectError
	return connectionLost(err) && !errors.As(err, &connectErr)
}

// connectionLost reports whether err means the statement's connection is
// gone or unusable while the database may still serve on another: no server
// answer at all (a closed or reset socket, a dial that failed), or one that
// ends the session (class 08, and 57P01 to 57P03: terminated by an
// administrator, a crash, or a server starting up). A context's end is not.
func connectionLost(err error) bool {
	if err == nil || pgconn.Timeout(err) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var (
		pgErr      *pgconn.PgError
		connectErr *pgconn.ConnectError
		netErr     net.Error
	)
	switch {
	case errors.As(err, &pgErr):
		switch pgErr.Code {
		case "57P01", "57P02", "57P03":
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08")
	case errors.As(err, &connectErr), errors.As(err, &netErr):
		return true
	}
	return pgconn.SafeToRetry(err) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}

// Sweep implements store.Sweeper: the expired records, then the expired
// steps, each batch one short statement of its own, bounded by the store's
// timeout, with a rest after each as WithSweepShare paces it. A rest that
// ctx would cut short ends the sweep early: it returns what it deleted and
// ctx's error, or context.DeadlineExceeded if ctx's deadline is still to come.
func (s *Store) Sweep(ctx context.Context, batchSize int) (int, error) {
	if batchSize < 1 {
		batchSize = store.DefaultSweepBatch
	}
	deleted := 0
	for _, sql := range []string{s.sweepSQL, s.sweepStepsSQL} {
		for {
			start := time.Now()
			n, err := s.sweepBatch(ctx, sql, batchSize)
			deleted += n
			if err != nil {
				return deleted, err
			}
			if n < batchSize {
				break
			}
			if rest := s.sweepRest(time.Since(start)); rest > 0 && !store.Pause(ctx, rest) {
				if err := ctx.Err(); err != nil {
					return deleted, err
				}
				return deleted, context.DeadlineExceeded // before the rest's end
			}
		}
	}
	return deleted, nil
}

// sweepRest is the rest after a sweep's statement that took took, so that
// the statements take WithSweepShare of the sweep's time.
func (s *Store) sweepRest(took time.Duration) time.Duration {
	if s.opts.sweepShare >= 1 {
		return 0
	}
	return time.Duration(float64(took) * (1/s.opts.sweepShare - 1))
}

func (s *Store) sweepBatch(ctx context.Context, sql string, batchSize int) (int, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	tag, err := s.pool.Exec(ctx, sql, batchSize)
	if err != nil {
		return 0, s.translate(ctx, "sweep", err)
	}
	return int(tag.RowsAffected()), nil
}

// bound applies the store's timeout to ctx, unless ctx's own deadline comes
// sooner: then it saves the timer.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= s.opts.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.timeout)
}

// translate turns a driver error into the store's own: an unreachable,
// failing-over, overloaded or slow database, or a cancelled call, is
// store.ErrUnavailable (the context's error kept); any other keeps only its
// SQLSTATE and message, which hold no raw key or tenant. The driver's error
// is logged at Debug, a server error without its detail.
func (s *Store) translate(ctx context.Context, op string, err error) error {
	pgErr := (*pgconn.PgError)(nil)
	if errors.As(err, &pgErr) {
		// Not the whole error: its detail may quote the values of a row,
		// such as those a handler wrote in atomic mode.
		s.opts.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey postgres: "+op+" failed",
			slog.String("sqlstate", pgErr.Code), slog.String("message", pgErr.Message),
			slog.String("table", pgErr.TableName), slog.String("constraint", pgErr.ConstraintName))
	} else {
		s.opts.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey postgres: "+op+" failed", slog.Any("error", err))
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("idemkey postgres: %s: %w: %w", op, store.ErrUnavailable, ctxErr)
	}
	if pgErr != nil {
		if statementCacheLost(pgErr.Code) {
			return fmt.Errorf("idemkey postgres: %s: %s", op, poolerHint)
		}
		if pgErr.Code == "42P01" && strings.Contains(pgErr.Message, s.opts.table) {
			return fmt.Errorf("idemkey postgres: %s: SQLSTATE %s: %s: the store's table or its sequence is gone: "+
				"if it was dropped, restore it from a backup; if it was never migrated, %s", op, pgErr.Code, pgErr.Message, s.opts.migrateHint())
		}
		if !unavailable(pgErr.Code) {
			return fmt.Errorf("idemkey postgres: %s: SQLSTATE %s: %s", op, pgErr.Code, pgErr.Message)
		}
		return fmt.Errorf("idemkey postgres: %s: %w: SQLSTATE %s: %s", op, store.ErrUnavailable, pgErr.Code, pgErr.Message)
	}
	// Not a server's answer: the connection failed, timed out or was closed,
	// or the pool is shutting down. The driver's text names hosts and users,
	// so it stays in the Debug log.
	if pgconn.Timeout(err) {
		return fmt.Errorf("idemkey postgres: %s: %w: timeout", op, store.ErrUnavailable)
	}
	return fmt.Errorf("idemkey postgres: %s: %w: no connection to the database", op, store.ErrUnavailable)
}

// poolerHint is the error of a statement that failed as statements cached by
// pgx fail behind a pooler in transaction mode.
const poolerHint = "the database does not keep the driver's prepared statements, as a pooler in transaction mode (pgbouncer) does not: add default_query_exec_mode=exec (or simple_protocol) to the database URL"

// statementCacheLost reports whether a server error comes from pgx's
// prepared statements on a connection through a pooler that gives each
// transaction any server connection (pgbouncer in transaction mode): a
// statement prepared on one server connection and run on another (26000), or
// prepared again on one that has it (42P05). The store prepares nothing of
// its own, and needs no session state.
func statementCacheLost(code string) bool { return code == "26000" || code == "42P05" }

// serializationFailure reports whether err is SQLSTATE 40001. Under READ
// COMMITTED, PostgreSQL's default, the store's statements never fail so; under
// a default of REPEATABLE READ or SERIALIZABLE they do when they race, and
// each one, being its own transaction, is safe to run again.
func serializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40001"
}

// unavailable reports whether a server error means the database cannot serve
// now but may soon: connection exceptions (class 08), insufficient resources
// (53), operator intervention such as a shutdown or statement_timeout (57),
// system errors (58), a transaction rolled back by a conflict (40), a lock not
// granted in time (55P03), and a read-only server after a failover (25006).
func unavailable(code string) bool {
	switch code {
	case "55P03", "25006":
		return true
	}
	if len(code) < 2 {
		return false
	}
	switch code[:2] {
	case "08", "40", "53", "57", "58":
		return true
	}
	return false
}
