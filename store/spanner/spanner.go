package spanner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"time"

	"cloud.google.com/go/spanner"
	"cloud.google.com/go/spanner/apiv1/spannerpb"
	"google.golang.org/grpc/codes"

	"github.com/idemkey/idemkey/store"
)

// DefaultTable is the table the migrations create and the store uses.
const DefaultTable = "idempotency_keys"

const defaultTimeout = 5 * time.Second

// Option configures a Store and Migrate.
type Option func(*options)

type options struct {
	table   string
	logger  *slog.Logger
	timeout time.Duration
}

// WithTable names the table: letters, digits and underscores, at most 48
// bytes, so that the steps' table "<name>_steps" fits Spanner's names. Pass
// the same option to Migrate and New.
func WithTable(name string) Option {
	return func(o *options) { o.table = name }
}

// WithLogger sets where the store logs: the driver's error behind each it
// translates, at Debug. Nil, the default, discards.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// WithTimeout bounds each operation (five seconds if d <= 0); Complete and
// Release ignore the caller's cancellation and use only this bound.
func WithTimeout(d time.Duration) Option {
	return func(o *options) { o.timeout = d }
}

var tableName = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]{0,47}$`)

func newOptions(opts []Option) (options, error) {
	o := options{table: DefaultTable}
	for _, opt := range opts {
		opt(&o)
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	if o.timeout <= 0 {
		o.timeout = defaultTimeout
	}
	if !tableName.MatchString(o.table) {
		return o, fmt.Errorf("idemkey spanner: table name %q: want a letter, then letters, digits or underscores, at most 48 bytes", o.table)
	}
	return o, nil
}

// Store is a store.Store on a Spanner table. Every decision about time uses
// Spanner's clock (CURRENT_TIMESTAMP() read in the deciding transaction),
// and fencing tokens are commit timestamps. It is safe for concurrent use.
type Store struct {
	client *spanner.Client
	opts   options
	table  string
	steps  string

	readSQL, findSQL, lookupSQL string
	stepSQL                     string // steps.go's
	// gate holds the store's read-write transactions to one at a time on
	// the emulator (see ended), nil on Spanner.
	gate chan struct{}
}

var (
	_ store.Store         = (*Store)(nil)
	_ store.Finder        = (*Store)(nil)
	_ store.BatchReserver = (*Store)(nil)
)

// New returns a store on client's database, whose table Migrate (or the
// user's own tool, from Migrations) created. It makes no call to the
// database and starts no goroutine: a missing table shows at the first
// call, which fails closed naming the fix.
func New(client *spanner.Client, opts ...Option) (*Store, error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	if client == nil {
		return nil, errors.New("idemkey spanner: New needs a client, not nil")
	}
	table, steps := o.table, o.table+"_steps"
	var gate chan struct{}
	if os.Getenv("SPANNER_EMULATOR_HOST") != "" {
		gate = make(chan struct{}, 1)
	}
	return &Store{
		gate:      gate,
		client:    client,
		opts:      o,
		table:     table,
		steps:     steps,
		readSQL:   fmt.Sprintf(readSQL, table),
		findSQL:   fmt.Sprintf(findSQL, table),
		lookupSQL: fmt.Sprintf(lookupSQL, table, steps),
		stepSQL:   fmt.Sprintf(stepSQL, table, steps),
	}, nil
}

// readSQL reads the records of the keys @keys in a read-write transaction,
// with the database's clock: a row per key, in @keys' order, whose columns
// are NULL for a key without a record. The read locks each key, so that the
// transaction that writes after it commits only if no other wrote between.
const readSQL = `SELECT CURRENT_TIMESTAMP(), k, r.outcome IS NOT NULL, r.fingerprint, r.token, r.seq, r.lease_end, r.outcome, r.created_at, r.expires_at
FROM UNNEST(@keys) AS k WITH OFFSET AS i LEFT JOIN %s AS r ON r.key = k ORDER BY i`

// findSQL reads a completed record that has not expired.
const findSQL = `SELECT fingerprint, outcome, expires_at FROM %s
WHERE key = @key AND outcome IS NOT NULL AND expires_at > CURRENT_TIMESTAMP()`

// record is a key's row as readSQL reads it.
type record struct {
	found       bool
	completed   bool
	fingerprint store.Fingerprint
	token       time.Time // the commit timestamp of its reservation
	seq         int64     // its place in the reservation's batch
	leaseEnd    time.Time
	outcome     []byte
	created     time.Time
	expires     time.Time
}

// readRecords reads the records of keys in txn, and the database's now.
func (s *Store) readRecords(ctx context.Context, txn interface {
	Query(context.Context, spanner.Statement) *spanner.RowIterator
}, keys ...store.Key) (now time.Time, recs []record, err error) {
	ks := make([][]byte, len(keys))
	for i := range keys {
		ks[i] = keys[i][:]
	}
	recs = make([]record, 0, len(keys))
	err = txn.Query(ctx, spanner.Statement{SQL: s.readSQL, Params: map[string]any{"keys": ks}}).Do(func(row *spanner.Row) error {
		var r record
		var err error
		now, _, r, err = scanRecord(row)
		recs = append(recs, r)
		return err
	})
	if err == nil && len(recs) != len(keys) {
		err = fmt.Errorf("idemkey spanner: read %d records of %d keys", len(recs), len(keys))
	}
	return now, recs, err
}

// scanRecord decodes a row of readSQL's columns, which recordsSQL's are
// too: the database's now, the key, and its record (not found if the key
// has none).
func scanRecord(row *spanner.Row) (now time.Time, key []byte, r record, err error) {
	var (
		completed                spanner.NullBool
		fingerprint, outcome     []byte
		token, leaseEnd, created spanner.NullTime
		expires                  spanner.NullTime
		seq                      spanner.NullInt64
	)
	if err := row.Columns(&now, &key, &completed, &fingerprint, &token, &seq, &leaseEnd, &outcome, &created, &expires); err != nil {
		return now, nil, record{}, err
	}
	r = record{found: token.Valid, completed: completed.Bool, token: token.Time, seq: seq.Int64, leaseEnd: leaseEnd.Time,
		outcome: outcome, created: created.Time, expires: expires.Time}
	copy(r.fingerprint[:], fingerprint)
	return now, key, r, nil
}

// expired reports whether the record counts as absent at now: past its
// retention, and completed or with its lease ended (store.Store).
func (r record) expired(now time.Time) bool {
	return !r.expires.After(now) && (r.completed || !r.leaseEnd.After(now))
}

// takeable reports whether a reservation of fp may take the record over:
// it has expired, or its lease has ended while the same request held it.
func (r record) takeable(fp store.Fingerprint, now time.Time) bool {
	return !r.found || r.expired(now) || (!r.completed && !r.leaseEnd.After(now) && r.fingerprint == fp)
}

// heldBy reports whether token holds the record in progress, unexpired.
func (r record) heldBy(t store.Token, now time.Time) bool {
	return r.found && !r.completed && token(r.token, r.seq) == t && (r.leaseEnd.After(now) || r.expires.After(now))
}

// entry is the answer of a record that a reservation may not take over.
func (r record) entry(now time.Time) store.Entry {
	res := store.Entry{State: store.Held, Fingerprint: r.fingerprint, Expires: r.expires}
	if r.completed {
		res.State, res.Outcome = store.Completed, r.outcome
	} else {
		res.RetryAfter = max(r.leaseEnd.Sub(now), 0)
	}
	return res
}

var recordColumns = []string{"key", "fingerprint", "token", "seq", "lease_end", "outcome", "created_at", "expires_at"}

// maxBatch is the most keys ReserveBatch takes: each key's token is the
// commit's timestamp in microseconds, times 1000, plus its place in the
// batch (the column seq).
const maxBatch = 1000

// token is the fencing token of the key at place seq of a reservation
// committed at ts. Spanner's commit timestamps are whole microseconds, and
// two commits that write one row differ, so no two reservations of one key
// share a token; the keys of one batch differ by seq.
func token(ts time.Time, seq int64) store.Token { return store.Token(ts.UnixMicro()*1000 + seq) }

// reserve decides the reservation rs[i] of the record rec read at now, and
// returns its answer and, if it acquires the key, the mutation that takes
// it, whose commit timestamp is its token.
func (s *Store) reserve(r store.Reservation, rec record, now time.Time, seq int64) (store.Entry, *spanner.Mutation) {
	if !rec.takeable(r.Fingerprint, now) {
		return rec.entry(now), nil
	}
	created, expires := now, now.Add(max(r.Retention, 0))
	if rec.found && !rec.expired(now) {
		// A takeover of a dead run keeps the record's life.
		created, expires = rec.created, rec.expires
	}
	m := spanner.InsertOrUpdate(s.table, recordColumns, []any{
		r.Key[:], r.Fingerprint[:], spanner.CommitTimestamp, seq, now.Add(max(r.Lease, 0)), nil, created, expires,
	})
	return store.Entry{State: store.Acquired, Expires: expires}, m
}

// Reserve implements store.Store in one read-write transaction: a read of
// the key's record with the database's clock, and the commit that carries
// the reservation's write, if any. Spanner retries the transaction when it
// aborts; the token is the commit's timestamp.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := s.ReserveBatch(ctx, []store.Reservation{r})
	if err != nil {
		return store.Entry{}, err
	}
	return res[0], nil
}

// ReserveBatch implements store.BatchReserver as Reserve does, every key in
// one transaction.
func (s *Store) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	if len(rs) == 0 {
		return nil, nil
	}
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if len(rs) > maxBatch {
		return nil, fmt.Errorf("idemkey spanner: reserve: a batch of %d keys; at most %d", len(rs), maxBatch)
	}
	keys := make([]store.Key, len(rs))
	seen := make(map[store.Key]bool, len(rs))
	for i := range rs {
		if seen[rs[i].Key] {
			return nil, errors.New("idemkey spanner: reserve: a batch names one key twice")
		}
		keys[i], seen[rs[i].Key] = rs[i].Key, true
	}
	res := make([]store.Entry, len(rs))
	resp, err := s.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		now, recs, err := s.readRecords(ctx, txn, keys...)
		if err != nil {
			return err
		}
		var ms []*spanner.Mutation
		for i, r := range rs {
			var m *spanner.Mutation
			res[i], m = s.reserve(r, recs[i], now, int64(i))
			if m != nil {
				ms = append(ms, m)
			}
		}
		return txn.BufferWrite(ms)
	})
	if err != nil {
		return nil, s.translate(ctx, "reserve", err)
	}
	for i := range res {
		if res[i].State == store.Acquired {
			res[i].Token = token(resp.CommitTs, int64(i))
		}
	}
	return res, nil
}

// Find implements store.Finder with one strong single-use read.
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	res := store.Entry{State: store.Completed}
	found := false
	err := s.client.Single().Query(ctx, spanner.Statement{SQL: s.findSQL, Params: map[string]any{"key": key[:]}}).Do(func(row *spanner.Row) error {
		var fingerprint []byte
		found = true
		if err := row.Columns(&fingerprint, &res.Outcome, &res.Expires); err != nil {
			return err
		}
		copy(res.Fingerprint[:], fingerprint)
		return nil
	})
	if err != nil {
		return store.Entry{}, false, s.translate(ctx, "find", err)
	}
	if !found {
		return store.Entry{}, false, nil
	}
	return res, true, nil
}

// maxCell is the most bytes a Spanner cell holds: an outcome larger than it
// is never written.
const maxCell = 10 << 20

// errTooLarge refuses an outcome over maxCell, writing nothing: the engine
// records its stand-in instead, as for a store at a bound.
var errTooLarge = fmt.Errorf("idemkey spanner: the outcome is larger than the %d bytes a Spanner cell holds: %w", maxCell, store.ErrFull)

// Complete implements store.Store, bounded by the store's timeout rather than
// ctx: a caller that hangs up must not leave its key in progress. An
// outcome over a cell's 10 MiB is store.ErrFull, writing nothing.
func (s *Store) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	if len(outcome) > maxCell {
		return errTooLarge
	}
	if outcome == nil {
		outcome = []byte{} // NULL means "in progress"
	}
	return s.write(ctx, "complete", key, token, func(time.Time) *spanner.Mutation {
		return spanner.Update(s.table, []string{"key", "outcome"}, []any{key[:], outcome})
	})
}

// Release implements store.Store, detached from ctx like Complete.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	return s.write(ctx, "release", key, token, func(time.Time) *spanner.Mutation {
		return spanner.Delete(s.table, spanner.Key{key[:]})
	})
}

// serializable is every transaction's options: whatever default isolation
// the user's client sets, a decision read in a transaction holds at its
// commit.
var serializable = spanner.TransactionOptions{IsolationLevel: spannerpb.TransactionOptions_SERIALIZABLE}

// transact runs f in a read-write transaction, which the client runs again
// when Spanner aborts it, and which transact runs again when the emulator
// lost it (ended): nothing of it committed. It returns the commit's answer.
func (s *Store) transact(ctx context.Context, f func(context.Context, *spanner.ReadWriteTransaction) error) (spanner.CommitResponse, error) {
	if s.gate != nil {
		select {
		case s.gate <- struct{}{}:
			defer func() { <-s.gate }()
		case <-ctx.Done():
			return spanner.CommitResponse{}, ctx.Err()
		}
	}
	for wait := retryPause; ; wait = min(2*wait, maxRetryPause) {
		resp, err := s.client.ReadWriteTransactionWithOptions(ctx, f, serializable)
		if !ended(err) || !store.Pause(ctx, jitter(wait)) {
			return resp, err
		}
	}
}

// Pauses between the attempts of a transaction the emulator lost.
const (
	retryPause    = time.Millisecond
	maxRetryPause = 100 * time.Millisecond
)

// jitter is a random wait up to d, so that transactions the emulator lost
// together do not start again together.
func jitter(d time.Duration) time.Duration { return rand.N(d) + 1 }

// ended reports whether err says that the transaction was gone before it
// committed, as the Cloud Spanner emulator says of a transaction that it
// ended for a newer one on the same session: it allows one read-write
// transaction at a time on a session, and the Go client runs every
// transaction on one (multiplexed) session. Spanner itself answers
// ABORTED, which the client retries; a transaction idle for over ten
// seconds is gone too. Nothing of such a transaction committed.
func ended(err error) bool {
	switch spanner.ErrCode(err) {
	case codes.NotFound:
		return strings.Contains(spanner.ErrDesc(err), "Transaction not found")
	case codes.FailedPrecondition:
		desc := spanner.ErrDesc(err)
		return strings.Contains(desc, "Invalid transaction ID") || strings.Contains(desc, "after it has been committed or rolledback") ||
			strings.Contains(desc, "after it has been rolled back")
	}
	return false
}

// errLeaseLost ends a write's transaction whose token no longer holds its key.
var errLeaseLost = fmt.Errorf("idemkey spanner: %w", store.ErrLeaseLost)

// write runs, in one read-write transaction, the write of op on the record
// of key that token holds in progress (its mutation made at the database's
// now), or returns store.ErrLeaseLost, writing nothing.
func (s *Store) write(ctx context.Context, op string, key store.Key, token store.Token, mutation func(now time.Time) *spanner.Mutation) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	_, err := s.transact(ctx, func(ctx context.Context, txn *spanner.ReadWriteTransaction) error {
		now, recs, err := s.readRecords(ctx, txn, key)
		if err != nil {
			return err
		}
		if !recs[0].heldBy(token, now) {
			return errLeaseLost
		}
		return txn.BufferWrite([]*spanner.Mutation{mutation(now)})
	})
	if errors.Is(err, store.ErrLeaseLost) {
		return fmt.Errorf("idemkey spanner: %s: %w", op, store.ErrLeaseLost)
	}
	if err != nil {
		return s.translate(ctx, op, err)
	}
	return nil
}

// bound applies the store's timeout to ctx, unless ctx's own deadline comes
// sooner.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= s.opts.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.timeout)
}

// translate turns a client error into the store's own: an unreachable,
// overloaded or slow database, a transaction aborted too often, or a
// cancelled call, is store.ErrUnavailable; a missing table names the fix.
// Spanner's message stays in the Debug log: it may quote the values of a
// row, such as those a handler wrote in atomic mode.
func (s *Store) translate(ctx context.Context, op string, err error) error {
	s.opts.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey spanner: "+op+" failed", slog.Any("error", err))
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("idemkey spanner: %s: %w: %w", op, store.ErrUnavailable, ctxErr)
	}
	code := spanner.ErrCode(err)
	switch code {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted, codes.ResourceExhausted, codes.Canceled, codes.Internal:
		return fmt.Errorf("idemkey spanner: %s: %w: %s", op, store.ErrUnavailable, code)
	case codes.NotFound, codes.InvalidArgument:
		if strings.Contains(spanner.ErrDesc(err), s.table) {
			return fmt.Errorf("idemkey spanner: %s: %s: the store's table %s is missing or not of this idemkey: run spanner.Migrate, or apply spanner.Migrations with your own tool", op, code, s.table)
		}
	}
	return fmt.Errorf("idemkey spanner: %s: %s", op, code)
}
