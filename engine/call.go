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

// request is what call.read took from a call with a key.
type request struct {
	Tenant      string
	Key         string // checked with idemkey.ValidateKey
	Fingerprint store.Fingerprint
	// Retried: a later attempt, whose record is read first (store.Finder).
	Retried bool
	// FirstSent is when the key's operation was first sent, or zero.
	FirstSent time.Time
	// FirstRegion is the region the key's operation was first sent to, read
	// only by an engine WithRegion; "" for none.
	FirstRegion string
	last        bool // Attempt.Last
}

// call is one call of an operation, from Engine.newCall to end.
type call struct {
	e     *Engine
	op    *Operation
	began time.Time // for its Debug line, and leaseEnd: the store starts the lease later
	// Verdict is what became of the call: set by start, or by call.read for
	// a call answered before it.
	Verdict Verdict
	// Outcome is the record to replay (Replayed); do not modify it.
	Outcome []byte
	// RetryAfter is the wait asked of a retry (InProgress, StoreFull).
	RetryAfter time.Duration
	// Expires is until when the key is honoured, the same for every call of
	// it (Answer.Expires); zero if the store cannot say, as for a running
	// atomic call whose session it cannot read: no expiry rather than a guess.
	Expires time.Time

	key          store.Key
	partition    store.Partition // the tenant's, in the context of each store call (storecalls.go)
	tenant       string
	userKey      string // the caller's key, for idemkey.DerivedKey
	started      bool
	token        store.Token
	tx           store.Tx
	fingerprint  store.Fingerprint // as reserved
	lease        time.Duration     // as reserved
	leaseEnd     time.Time         // when, at the earliest, the store ends the lease
	running      *running          // the handler's context, while it runs (step.go)
	step         string            // the step that made the verdict OutcomeUnknown, for the hooks
	ended        bool              // recorded or released
	stale        bool              // first sent too long ago to run if the key has no record
	unopened     bool              // StoreUnavailable because the key's record does not open
	recorded     bool              // the outcome was recorded (noteWrite), for the hooks
	recordedSize int
}

func (e *Engine) newCall(op *Operation) call {
	return call{e: e, op: op, began: time.Now(), Verdict: Refused}
}

// start decides what the call does and sets Verdict: Executed (the call
// holds the key), FailedOpen (the handler runs, nothing is recorded), or an
// answer without the handler. A call answered InProgress may be started
// again, to wait for the key within the one call (TestStartAgain).
func (c *call) start(ctx context.Context, r request) {
	e, op := c.e, c.op
	fp := c.identify(r)
	if !c.checkFirstSent(r.FirstSent) {
		return
	}
	if e.fenced(r) {
		c.fence(ctx, r, fp)
		return
	}
	if e.finder != nil && r.Retried {
		res, found, err := e.find(ctx, c.partition, c.key)
		if err == nil && found {
			c.answer(fp, res)
			return
		}
		// Failing closed, a store that cannot read cannot reserve either:
		// answer now rather than wait on it twice.
		if err != nil && !e.failsOpen(op) {
			c.storeFailed(ctx, "find", err)
			return
		}
	}
	res := store.Reservation{
		Key:         c.key,
		Fingerprint: fp,
		Lease:       e.lease(ctx, op),
		Retention:   op.retention,
		MaxOutcome:  e.opts.maxRecord, // a store with bounds sets room aside for it
		Partition:   c.partition,
	}
	c.fingerprint, c.lease = fp, res.Lease
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

// firstSent reads Exchange.FirstSent: zero without one, and a
// *FirstSentError for a value sent twice, not an HTTP date, or later than
// the clock skew from now.
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

// firstRegionOf reads Exchange.FirstRegion: "" without one, and a
// *FirstSentError for a value sent twice or not a region name.
func firstRegionOf(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", nil
	case 1:
	default:
		return "", &FirstSentError{"its first region (" + idemkey.FirstRegionHeader + ") was sent more than once"}
	}
	v := strings.Trim(values[0], " \t")
	if err := idemkey.ValidateRegion(v); err != nil {
		return "", &FirstSentError{"its first region (" + idemkey.FirstRegionHeader + ") is not a region name: " + err.Error()}
	}
	return v, nil
}

// fenced reports whether r was first sent to a region other than the
// engine's (WithRegion).
func (e *Engine) fenced(r request) bool {
	return r.FirstRegion != "" && r.FirstRegion != e.opts.region
}

// fence decides a call first sent to another region: it runs nothing here.
// The key's record, once replication has brought it, is answered as any
// call's is (replayed, in progress, reused); without one the call is Fenced,
// answered InProgress, or Expired if first sent longer ago than the
// retention. A store that fails answers StoreUnavailable even with
// WithFailOpen: only the first region may run the key.
func (c *call) fence(ctx context.Context, r request, fp store.Fingerprint) {
	e := c.e
	var (
		res   store.Entry
		found bool
		err   error
		op    = "find"
	)
	if e.finder != nil {
		res, found, err = e.find(ctx, c.partition, c.key)
	} else {
		op = "reserve"
		res, found, err = c.probe(ctx, r, fp)
	}
	switch {
	case errors.Is(err, store.ErrFull):
		c.Verdict, c.RetryAfter = StoreFull, e.opts.retryAfter
		c.log(ctx, slog.LevelWarn, "reserve refused: the store is full", err)
	case err != nil:
		c.storeFailed(ctx, op, err)
	case found:
		c.answer(fp, res)
	case c.stale:
		c.Verdict = Expired
	default:
		c.Verdict, c.RetryAfter = Fenced, e.opts.retryAfter
	}
}

// probe tells whether the key has a record on a store that cannot Find: it
// reserves the key under a short lease, with room for a small outcome only,
// and releases at once a key it acquired, which has none.
func (c *call) probe(ctx context.Context, r request, fp store.Fingerprint) (store.Entry, bool, error) {
	e := c.e
	got, err := e.reserve(ctx, store.Reservation{
		Key:         c.key,
		Fingerprint: fp,
		Lease:       leaseGrace, // a probe that dies unreleased holds the key no longer
		Retention:   c.op.retention,
		MaxOutcome:  store.SmallOutcome,
		Partition:   c.partition,
	})
	if err != nil || got.State != store.Acquired {
		return got, err == nil, err
	}
	c.token = got.Token
	if err := e.storeRelease(ctx, c); err != nil {
		c.logWriteFailure(context.WithoutCancel(ctx), "release", err)
	}
	c.token = 0
	return store.Entry{}, false, nil
}

// checkFirstSent sets c.stale, and returns false (FirstSentInvalid) for a t
// in the future beyond the clock skew.
func (c *call) checkFirstSent(t time.Time) bool {
	if t.IsZero() {
		return true
	}
	age, skew, retention := time.Since(t), c.e.opts.clockSkew, c.op.retention
	if age < -skew {
		c.Verdict = FirstSentInvalid
		return false
	}
	c.stale = age > retention-min(skew, retention/2)
	return true
}

// begin is start in atomic mode: it reserves the key in a transaction that
// the handler then writes in. A duplicate of a running call waits with
// further Begins, which the store answers without waiting on the running
// call, and acquires the key if the first call rolls back meanwhile.
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

// answer sets the verdict of a key that was not acquired.
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

// maxRetryAfter bounds the wait asked of a retry: for a transport that
// redelivers, the longest lease, so that a redelivery waits out the other run.
func (c *call) maxRetryAfter() time.Duration {
	if c.op.redelivers {
		return c.e.opts.maxLease
	}
	return c.e.opts.retryAfter
}

// wait is how long a call waits for its key in progress elsewhere: a last
// attempt as long as the longest lease, since no retry will come to take the
// key over; other redeliveries none.
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

func (c *call) inTx() bool { return c.tx != nil }

// handlerContext is contextFor(ctx) under the HandlerTimeout.
func (c *call) handlerContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return c.op.timed(c.contextFor(ctx))
}

// timed is ctx under op's HandlerTimeout, if it has one.
func (op *Operation) timed(ctx context.Context) (context.Context, context.CancelFunc) {
	if op.timeout > 0 {
		return context.WithTimeout(ctx, op.timeout)
	}
	return ctx, func() {}
}

// contextFor carries the call's parts for idemkey.DerivedKey, in atomic
// mode the transaction, and for a call that holds its key, what Step needs.
func (c *call) contextFor(ctx context.Context) context.Context {
	ctx = idemkey.HandlerContext(ctx, c.tenant, c.op.name, c.userKey)
	if c.tx != nil {
		ctx = c.tx.HandlerContext(ctx)
	}
	if c.Verdict == Executed {
		ctx = c.newRunning(ctx)
	}
	return ctx
}

// newRunning is ctx carrying the call's steps (Step), for a call that holds
// its key.
func (c *call) newRunning(ctx context.Context) *running {
	c.running = &running{Context: ctx, e: c.e, op: c.op, key: c.key, partition: c.partition, token: c.token, fp: c.fingerprint,
		tenant: c.tenant, userKey: c.userKey}
	return c.running
}

// stepVerdict is what the call's steps made of it: Executed if nothing
// (stepVerdict); then the key is released, keeping its steps, and the call
// answered as it says.
func (c *call) stepVerdict() (v Verdict, forget bool) {
	if c.running == nil {
		return Executed, false
	}
	v, c.step, forget = c.running.stepVerdict()
	return v, forget
}

// stepEnded sets the verdict v of a call that a step ended (stepVerdict),
// whose key its caller released, keeping its steps.
func (c *call) stepEnded(v Verdict) {
	c.Verdict = v
	if v == StoreFull {
		c.RetryAfter = c.e.opts.retryAfter
	}
}

// forgetSteps deletes the steps of a call released with ForgetSteps.
func (c *call) forgetSteps(ctx context.Context) {
	if err := c.e.forgetSteps(context.WithoutCancel(ctx), c.partition, c.key, c.token); err != nil {
		c.log(ctx, slog.LevelError, "forgetting the steps of a released call (ForgetSteps) failed; the retry gets their results", err)
	}
}

// record records outcome for an Executed call; keepWrites false (a recorded
// error) undoes the handler's writes in atomic mode. The write ignores ctx's
// cancellation: a caller that hangs up must not leave its key in progress.
// ErrTooLarge or store.ErrFull: nothing was written, record the stand-in.
// errSuperseded: answer as Verdict now says. Another error, in atomic mode:
// nothing, or perhaps everything, committed. In two-phase mode another
// failure is retried in the background, and record returns nil.
func (c *call) record(ctx context.Context, outcome []byte, keepWrites bool) error {
	e := c.e
	if c.tx == nil {
		// The handler has run: from here on the key is never released, even
		// if no record can be written; it stays in progress until its lease
		// ends.
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
// call, and sets the verdict errSuperseded promises.
func (c *call) superseded(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	c.Verdict = InProgress
	res := store.Entry{State: store.Held, Fingerprint: c.fingerprint, RetryAfter: c.e.opts.retryAfter}
	if c.e.finder != nil {
		found, ok, err := c.e.find(ctx, c.partition, c.key)
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

// release frees the key of an Executed call: the record is deleted, or in
// atomic mode the transaction rolls back with the handler's writes.
func (c *call) release(ctx context.Context) {
	if c.ended {
		return
	}
	c.ended = true
	if c.tx != nil {
		if err := c.tx.Rollback(store.ContextWithPartition(ctx, c.partition)); err != nil {
			c.log(ctx, slog.LevelWarn, "rollback failed; the database rolls back when it closes the connection", err)
		}
		return
	}
	if err := c.e.storeRelease(ctx, c); err != nil {
		c.logWriteFailure(context.WithoutCancel(ctx), "release", err)
	}
}

// abandon, deferred, releases the key of a handler that panicked.
func (c *call) abandon(ctx context.Context) {
	if c.Verdict == Executed && !c.ended {
		c.release(ctx)
	}
}

// end records the call's metrics, span event and Debug line, then runs its
// hook, once its verdict and code are final and before the entry point
// hands the answer over.
func (c *call) end(ctx context.Context, code int) {
	c.e.obs.callEnded(ctx, c, code)
	c.runHooks(ctx, code)
}

const (
	laterFirstPause = 100 * time.Millisecond
	laterMaxPause   = 5 * time.Second
)

// completeLater tries to record outcome until shortly before the lease ends,
// after which a retry may take the key over, and logs how that ended.
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

// log logs msg with the operation and the scope (a prefix of the key's hash,
// never the key).
func (c *call) log(ctx context.Context, level slog.Level, msg string, err error) {
	attrs := []slog.Attr{slog.String("operation", c.op.name)}
	if c.started {
		attrs = append(attrs, slog.String("scope", c.key.String()))
	}
	c.e.opts.logger.LogAttrs(ctx, level, "idemkey: "+msg, append(attrs, slog.Any("error", err))...)
}

// failsOpen reports whether a store failure runs op's handler unprotected:
// never in atomic mode, nor for a transport that redelivers.
func (e *Engine) failsOpen(op *Operation) bool {
	return e.opts.failOpen && !op.atomic && !op.redelivers
}

// lease is the time a call has left (its deadline, or op's HandlerTimeout if
// sooner) plus a grace period, at most the maximum lease; without either,
// the default lease. It saturates: gRPC turns a huge grpc-timeout into a
// deadline math.MaxInt64 nanoseconds away.
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

// bindOperation hashes a fingerprint with the operation it was made for.
func bindOperation(operation string, fp store.Fingerprint) store.Fingerprint {
	return sha256.Sum256(append(store.AppendParts(make([]byte, 0, 256), operation), fp[:]...))
}
