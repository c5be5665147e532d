package engine

import (
	"context"
	"crypto/sha256"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// request is what call.read took from one call's Exchange, for a call with
// a key.
type request struct {
	Tenant      string
	Key         string // checked with idemkey.ValidateKey
	Fingerprint store.Fingerprint
	// Retried is true when the transport marks the call as a later attempt
	// (gRPC's grpc-previous-rpc-attempts, a broker's redelivery): its record
	// is read first, on a store that implements store.Finder.
	Retried bool
	// FirstSent is when the client first sent the key's operation (gRPC's
	// idempotency-first-sent metadata, the Idempotency-First-Sent header, a
	// message's broker timestamp), or zero if it did not say. A call first
	// sent longer ago than the retention is refused rather than run again
	// when its key has no record (see WithClockSkew).
	FirstSent time.Time

	last bool // Attempt.Last
}

// call is one call of an operation, from its start to its answer. Its zero
// value is not usable: get one from Engine.newCall, and end it with end.
type call struct {
	e     *Engine
	op    *Operation
	began time.Time // for its Debug line, and leaseEnd: the store starts the lease later

	// Verdict is what became of the call. start sets it; call.read sets it
	// for a call answered before start (no key, a malformed one, a refused
	// request).
	Verdict Verdict
	// Outcome is the record to replay when Verdict is Replayed. It must not be
	// modified.
	Outcome []byte
	// RetryAfter is how long the caller should wait before retrying when
	// Verdict is InProgress or StoreFull.
	RetryAfter time.Duration
	// Expires is the instant until which the call's key is honoured, when
	// Verdict is Executed, Replayed, InProgress or Reused: its record's creation
	// plus the retention, on the store's clock, the same for every call of
	// the key: for an atomic call in flight too, whose record the store
	// reads from the running call's start (store/postgres). Answer.Expires
	// carries it to the entry point, which tells it to the client
	// (idemkey.ExpiresHeader). Zero if the store cannot say,
	// as for a running atomic call whose session the store cannot read:
	// then no expiry is told rather than a guessed one.
	Expires time.Time

	key         store.Key
	tenant      string
	userKey     string // the caller's key, for idemkey.DerivedKey
	started     bool
	token       store.Token
	tx          store.Tx
	fingerprint store.Fingerprint // as reserved, in atomic mode
	leaseEnd    time.Time         // when, at the earliest, the store ends the lease
	ended       bool              // recorded or released
	stale       bool              // first sent too long ago to run if the key has no record
	unopened    bool              // StoreUnavailable because the key's record does not open

	recorded     bool // the outcome was recorded (noteWrite), for the hooks
	recordedSize int
}

// newCall starts timing a call of op.
func (e *Engine) newCall(op *Operation) call {
	return call{e: e, op: op, began: time.Now(), Verdict: Refused}
}

// start decides what the call does, and sets Verdict:
//   - Executed: the call holds the key. serve runs the handler with
//     handlerContext, then records its outcome (record) or releases the key
//     (release), with abandon deferred for panics.
//   - FailedOpen: the store failed and WithFailOpen holds: serve runs the
//     handler with contextFor, and neither records nor releases.
//   - Replayed: answer with Outcome, without running the handler.
//   - InProgress: answer "in progress", retry after RetryAfter.
//   - Reused: answer "reused".
//   - StoreUnavailable: answer "store unavailable", or, if ctx is done, its
//     error.
//   - StoreFull: the store has no room for a new key with a record of
//     WithMaxRecordSize bytes, in all or for the call's tenant: answer
//     "store full", retry after RetryAfter.
//   - Expired: r.FirstSent is older than the retention (less the clock
//     skew) and the key has no record: answer "key expired".
//   - FirstSentInvalid: r.FirstSent is later than the clock skew from now.
//
// A call answered InProgress may be started again with the same request,
// to wait for the key within the one call, which end counts once
// (TestStartAgain). Serve starts each call once; ServeBatch serves a last
// delivery that its batch found in progress on its own, where it waits.
func (c *call) start(ctx context.Context, r request) {
	e, op := c.e, c.op
	fp := c.identify(r)
	if !c.checkFirstSent(r.FirstSent) {
		return
	}
	if e.finder != nil && r.Retried {
		res, found, err := e.find(ctx, c.key)
		if err == nil && found {
			c.answer(fp, res)
			return
		}
		// Failing closed, a store that cannot read cannot reserve either:
		// answer now rather than wait on it twice. Failing open, the
		// reservation is tried all the same before the handler runs bare.
		if err != nil && !e.failsOpen(op) {
			c.storeFailed(ctx, "find", err)
			return
		}
	}
	res := store.Reservation{
		Key:         c.key,
		Fingerprint: fp,
		Lease:       e.lease(ctx, op),
		Retention:   e.opts.retention,
		MaxOutcome:  e.opts.maxRecord,                // a store with bounds sets room aside for it
		Partition:   store.TenantPartition(r.Tenant), // once per call, even when it waits and reserves again
	}
	c.leaseEnd = c.began.Add(res.Lease) // the store's clock starts it later, never earlier
	if op.atomic {
		c.begin(ctx, res, c.wait(r))
		return
	}

	got, err := e.reserve(ctx, res)
	if err == nil && got.State == store.Held && got.Fingerprint == fp {
		got, err = e.await(ctx, waited{res.Key, fp, false}, c.wait(r), got, func(ctx context.Context) (store.Entry, error) { return e.reserve(ctx, res) })
	}
	switch {
	case errors.Is(err, store.ErrFull):
		c.Verdict, c.RetryAfter = StoreFull, e.opts.retryAfter
		c.log(ctx, slog.LevelWarn, "reserve refused: the store is full", err)
	case err != nil && e.failsOpen(op) && !c.stale && ctx.Err() == nil && !errors.Is(err, errUnopened):
		c.Verdict = FailedOpen
		c.log(ctx, slog.LevelError, "reserve failed; the handler runs unprotected (WithFailOpen)", err)
	case err != nil:
		c.storeFailed(ctx, "reserve", err)
	case got.State != store.Acquired:
		c.answer(fp, got)
	default:
		c.Verdict, c.token, c.Expires = Executed, got.Token, got.Expires
		if c.stale {
			c.release(ctx)
			c.Verdict, c.Expires = Expired, time.Time{}
		}
	}
}

// firstSent reads the time a call's operation was first sent from the
// values of its transport's field (Exchange.FirstSent): zero without one. A
// value sent twice, that is not an HTTP date (idemkey.ParseDate, after
// surrounding spaces and tabs, which HTTP trims from a field value, are
// trimmed on every transport) or that lies later than the clock skew from
// now (WithClockSkew) gives a *FirstSentError, answered FirstSentInvalid.
func (e *Engine) firstSent(values []string) (time.Time, error) {
	switch len(values) {
	case 0:
		return time.Time{}, nil
	case 1:
	default:
		return time.Time{}, &FirstSentError{"it was sent more than once"}
	}
	t, err := idemkey.ParseDate(strings.Trim(values[0], " \t"))
	if err != nil {
		return time.Time{}, &FirstSentError{"it is not an HTTP date, such as " + idemkey.FormatDate(time.Now())}
	}
	if time.Until(t) > e.opts.clockSkew {
		return time.Time{}, &FirstSentError{"it lies in the future, beyond the clock skew allowed"}
	}
	if epoch := time.Unix(0, 0); t.Before(epoch) {
		t = epoch // the zero time means "not sent"; a date that old is as stale as 1970
	}
	return t, nil
}

// checkFirstSent sets c.stale for a call first sent at t (zero: unknown),
// and returns false, with the verdict FirstSentInvalid, for a t in the
// future beyond the clock skew.
func (c *call) checkFirstSent(t time.Time) bool {
	if t.IsZero() {
		return true
	}
	age, o := time.Since(t), c.e.opts
	if age < -o.clockSkew {
		c.Verdict = FirstSentInvalid
		return false
	}
	c.stale = age > o.retention-min(o.clockSkew, o.retention/2)
	return true
}

// begin is start in atomic mode: it reserves the key in a transaction, which
// the handler then writes in. A duplicate of a running call waits with
// further Begins, which an atomic store answers without waiting on the
// running call (store/postgres: in one round trip, on a connection that no
// new key is waiting for), and acquires the key if the first call rolls
// back meanwhile.
func (c *call) begin(ctx context.Context, r store.Reservation, wait time.Duration) {
	e := c.e
	res, tx, err := e.begin(ctx, r)
	if err == nil && res.State == store.Held && res.Fingerprint == r.Fingerprint {
		res, err = e.await(ctx, waited{r.Key, r.Fingerprint, true}, wait, res, func(ctx context.Context) (store.Entry, error) {
			res, t, err := e.begin(ctx, r)
			tx = t
			return res, err
		})
	}
	switch {
	case err != nil:
		c.storeFailed(ctx, "reserve", err)
	case res.State != store.Acquired:
		c.answer(r.Fingerprint, res)
	default:
		c.Verdict, c.tx, c.fingerprint, c.Expires = Executed, tx, r.Fingerprint, res.Expires
		if c.stale {
			c.release(ctx)
			c.Verdict, c.Expires = Expired, time.Time{}
		}
	}
}

// answer sets the verdict of a key that was not acquired: a replay of the
// recorded outcome, or the key is in progress, or reused.
func (c *call) answer(fp store.Fingerprint, res store.Entry) {
	c.Expires = res.Expires // zero when the store cannot tell: no expiry rather than a wrong one
	switch {
	case res.Fingerprint != fp: // checked first, in either state
		c.Verdict = Reused
	case res.State == store.Completed:
		c.Verdict, c.Outcome = Replayed, res.Outcome
	default:
		c.Verdict = InProgress
		c.RetryAfter = max(min(res.RetryAfter, c.maxRetryAfter()), time.Millisecond)
	}
}

// maxRetryAfter bounds the wait asked of a retry: WithMaxRetryAfter, or for
// an operation whose transport redelivers, the longest lease, so that a
// redelivery waits out the other run's.
func (c *call) maxRetryAfter() time.Duration {
	if c.op.redelivers {
		return c.e.opts.maxLease
	}
	return c.e.opts.retryAfter
}

// wait is how long a call of r waits for its key in progress elsewhere:
// WithInProgressWait; none for a transport that redelivers, except on a
// call's last attempt, which waits as long as the longest lease, since no
// retry will come to take the key over.
func (c *call) wait(r request) time.Duration {
	switch {
	case r.last:
		return c.e.opts.maxLease
	case c.op.redelivers:
		return 0
	}
	return c.e.opts.inProgress
}

func (c *call) storeFailed(ctx context.Context, op string, err error) {
	c.Verdict = StoreUnavailable
	c.unopened = errors.Is(err, errUnopened)
	if ctx.Err() == nil {
		c.log(ctx, slog.LevelError, op+" failed", err)
	}
}

// inTx reports whether the call runs in a transaction of the store's
// (atomic mode), whose failed commit undoes the handler's writes.
func (c *call) inTx() bool { return c.tx != nil }

// handlerContext is contextFor(ctx), ended after the operation's
// HandlerTimeout, if it has one.
func (c *call) handlerContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return c.op.timed(c.contextFor(ctx))
}

// timed is ctx, ended after op's HandlerTimeout, if it has one.
func (op *Operation) timed(ctx context.Context) (context.Context, context.CancelFunc) {
	if op.timeout > 0 {
		return context.WithTimeout(ctx, op.timeout)
	}
	return ctx, func() {}
}

// contextFor is ctx for the handler: it carries the call's parts for
// idemkey.DerivedKey and, in atomic mode, the transaction.
func (c *call) contextFor(ctx context.Context) context.Context {
	ctx = idemkey.HandlerContext(ctx, c.tenant, c.op.name, c.userKey)
	if c.tx != nil {
		ctx = c.tx.HandlerContext(ctx)
	}
	return ctx
}

// record records outcome for an Executed call, the entry point's encoding
// of the handler's result (HandlerResult.Record), which replays from then
// on. keepWrites is false for a recorded error: in atomic mode the
// handler's writes are then undone, and only the record commits.
//
// It detaches the store write from ctx's cancellation: a caller that hangs up
// must not leave its key in progress. Its error tells run to change the
// answer:
//   - ErrTooLarge, or store.ErrFull (no room in a store with bounds that
//     set none aside when the key was reserved: store/redis out of memory):
//     nothing was written; recordInstead records the stand-in
//     (Exchange.StandIn, at most store.SmallOutcome bytes) in its place,
//     and answers it.
//   - errSuperseded (atomic mode): another call recorded the key first, and
//     nothing of this one committed; the answer is as Verdict now says.
//   - any other error (atomic mode): nothing, or perhaps everything,
//     committed; answer "store unavailable", and a retry finds out.
//
// In two-phase mode a write that fails for another reason is retried in the
// background until shortly before the lease ends (one refused with
// store.ErrLeaseLost or store.ErrDataLost is only logged), and record
// returns nil: the handler has run, so the caller gets its result. Once
// record is called in two-phase mode, the key is never released: if even the
// stand-in cannot be recorded, the key stays in progress until its lease
// ends, and the entry point still answers the stand-in.
func (c *call) record(ctx context.Context, outcome []byte, keepWrites bool) error {
	e := c.e
	if c.tx == nil {
		// The handler has run: from here on the key is never released, even
		// if no record can be written; it stays in progress until its lease
		// ends. (In atomic mode, release rolls the handler's writes back too.)
		c.ended = true
	}
	if len(outcome) > e.opts.maxRecord {
		c.log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead",
			tooLarge(len(outcome), e.opts.maxRecord))
		return ErrTooLarge
	}
	if c.tx != nil {
		c.ended = true
		err := e.commit(ctx, c, outcome, keepWrites)
		if errors.Is(err, store.ErrLeaseLost) {
			return c.superseded(ctx)
		}
		if err != nil {
			c.log(ctx, slog.LevelError, "commit failed; the call's writes and record were rolled back, or their fate is unknown, and a retry finds out", err)
			return err
		}
		e.obs.recorded(ctx, c.op, len(outcome))
		return nil
	}
	err := e.complete(ctx, c, outcome)
	if !errors.Is(err, store.ErrFull) {
		e.obs.recorded(ctx, c.op, len(outcome))
	}
	if err == nil {
		return nil
	}
	ctx = context.WithoutCancel(ctx) // for the log, and the goroutine
	switch {
	case errors.Is(err, store.ErrFull):
		c.logWriteFailure(ctx, "complete", err)
		return err
	case errors.Is(err, store.ErrLeaseLost), errors.Is(err, store.ErrDataLost):
		c.logWriteFailure(ctx, "complete", err)
	default:
		c.log(ctx, slog.LevelError, "complete failed; it is tried again in the background until shortly before the lease ends", err)
		later := *c // a copy, so that c itself stays on its caller's stack
		go later.completeLater(ctx, outcome)
	}
	return nil
}

// superseded reads the record of a call whose commit lost the key to another
// call, and sets the verdict record's errSuperseded promises.
func (c *call) superseded(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	c.Verdict = InProgress
	res := store.Entry{State: store.Held, Fingerprint: c.fingerprint, RetryAfter: c.e.opts.retryAfter}
	if c.e.finder != nil {
		found, ok, err := c.e.find(ctx, c.key)
		switch {
		case err != nil:
			c.storeFailed(ctx, "find", err)
			return errSuperseded
		case ok:
			res = found
		}
	}
	c.answer(c.fingerprint, res)
	return errSuperseded
}

// release gives up the key of an Executed call, so that a retry runs the
// handler again: the record is deleted, or in atomic mode the transaction
// with the handler's writes rolls back.
func (c *call) release(ctx context.Context) {
	if c.ended {
		return
	}
	c.ended = true
	if c.tx != nil {
		if err := c.tx.Rollback(ctx); err != nil {
			c.log(ctx, slog.LevelWarn, "rollback failed; the database rolls back when it closes the connection", err)
		}
		return
	}
	if err := c.e.storeRelease(ctx, c); err != nil {
		c.logWriteFailure(context.WithoutCancel(ctx), "release", err)
	}
}

// abandon releases the key of an Executed call that was neither recorded nor
// released: deferred, it covers a handler that panics.
func (c *call) abandon(ctx context.Context) {
	if c.Verdict == Executed && !c.ended {
		c.release(ctx)
	}
}

// end measures the call: the idemkey.calls counter with its verdict and
// code (the transport's status, which the operation's MetricsSpec names),
// an event on the call's span, and a Debug log line; then it runs the hook
// of its verdict (WithHooks). Serve and ServeBatch call it once a call,
// when the verdict and the code are final (after Exchange.Answer or
// Exchange.Pass), before the entry point hands the answer over.
func (c *call) end(ctx context.Context, code int) {
	c.e.obs.callEnded(ctx, c, code)
	c.runHooks(ctx, code)
}

// Pauses between the background attempts of completeLater.
const (
	laterFirstPause = 100 * time.Millisecond
	laterMaxPause   = 5 * time.Second
)

// completeLater tries to record outcome until shortly before the lease ends
// (a quarter of it before, at most a second), and logs how that ended. Past
// that point a retry may take the key over, and the record would be refused
// anyway.
func (c *call) completeLater(ctx context.Context, outcome []byte) {
	e := c.e
	until := c.leaseEnd.Add(-min(max(time.Until(c.leaseEnd), 0)/4, time.Second))
	err := errors.New("no time was left before the lease ends")
	for attempt, pause := 2, laterFirstPause; time.Until(until) > pause; attempt, pause = attempt+1, min(2*pause, laterMaxPause) {
		time.Sleep(pause)
		wctx, cancel := context.WithDeadline(ctx, until)
		err = e.complete(wctx, c, outcome)
		cancel()
		switch {
		case err == nil:
			e.opts.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey: complete succeeded in the background",
				slog.String("operation", c.op.name), slog.String("scope", c.key.String()), slog.Int("attempt", attempt))
			return
		case errors.Is(err, store.ErrLeaseLost), errors.Is(err, store.ErrFull), errors.Is(err, store.ErrDataLost):
			c.logWriteFailure(ctx, "complete", err)
			return
		}
	}
	c.log(ctx, slog.LevelError, "complete failed until shortly before the lease ends; a retry after it runs the handler again", err)
}

func (c *call) logWriteFailure(ctx context.Context, op string, err error) {
	switch {
	case errors.Is(err, store.ErrLeaseLost):
		c.log(ctx, slog.LevelWarn, op+" refused: the lease was taken over, so another run of the handler may have happened", err)
	case errors.Is(err, store.ErrFull):
		c.log(ctx, slog.LevelError, op+" refused: the store is full; Internal is recorded instead of the reply", err)
	case errors.Is(err, store.ErrDataLost):
		c.log(ctx, slog.LevelError, op+" refused: the store lost its data, and fails every call until it is fixed", err)
	default:
		c.log(ctx, slog.LevelError, op+" failed; the key stays in progress until its lease ends", err)
	}
}

// log logs msg about the call at level, with its operation, its scope (a
// prefix of the key's hash, never the key) and err.
func (c *call) log(ctx context.Context, level slog.Level, msg string, err error) {
	attrs := []slog.Attr{slog.String("operation", c.op.name)}
	if c.started {
		attrs = append(attrs, slog.String("scope", c.key.String()))
	}
	c.e.opts.logger.LogAttrs(ctx, level, "idemkey: "+msg, append(attrs, slog.Any("error", err))...)
}

// failsOpen reports whether a store failure runs op's handler unprotected:
// with WithFailOpen, except in atomic mode and for a transport that
// redelivers, which tries again later rather than run unprotected.
func (e *Engine) failsOpen(op *Operation) bool {
	return e.opts.failOpen && !op.atomic && !op.redelivers
}

// lease is the time a call of op has left, its remaining deadline or op's
// HandlerTimeout if that is sooner, plus a grace period, at most the maximum
// lease; a call with neither gets the default lease. It saturates: gRPC
// turns a grpc-timeout above about 2562047H into a deadline math.MaxInt64
// nanoseconds away, to which the grace cannot be added.
func (e *Engine) lease(ctx context.Context, op *Operation) time.Duration {
	var left time.Duration
	deadline, ok := ctx.Deadline()
	if ok { // the clock is read only for a deadline
		left = max(time.Until(deadline), 0)
	}
	if t := op.timeout; t > 0 && (!ok || t < left) {
		left, ok = t, true
	}
	if !ok {
		return e.opts.lease
	}
	if left > e.opts.maxLease-leaseGrace {
		return e.opts.maxLease
	}
	return left + leaseGrace
}

// bindOperation hashes a fingerprint together with the operation it was made
// for.
func bindOperation(operation string, fp store.Fingerprint) store.Fingerprint {
	return sha256.Sum256(append(store.AppendParts(make([]byte, 0, 256), operation), fp[:]...))
}
