package engine

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Verdict is what became of a call: the idemkey.outcome of its metrics,
// span and Debug line.
type Verdict uint8

const (
	Executed         Verdict = iota // the handler ran under the key (its status tells recorded or released)
	Replayed                        // the recorded outcome was replayed
	InProgress                      // the first call still runs
	Reused                          // the key was first used with another request
	KeyMissing                      // WithKeyRequired and no key
	KeyInvalid                      // a malformed key
	NoKey                           // no key, none required: the handler ran unprotected
	StoreUnavailable                // the store failed; the handler did not run
	StoreFull                       // no room for a new key; the handler did not run
	FailedOpen                      // the store failed and WithFailOpen ran the handler unprotected
	Refused                         // the tenant or the request was refused, or the call cannot be replayed
	Expired                         // the key's operation was first sent longer ago than the retention, and it has no record: not run
	FirstSentInvalid                // the first-sent time is malformed, or in the future, or the first region malformed (WithRegion): not run
	OutcomeUnknown                  // a step an earlier run started never finished, and nothing could tell its outcome (Step): the key is released
	Fenced                          // first sent to another region, whose record has not arrived (WithRegion): answered InProgress, not run
	numVerdicts
)

var verdictNames = [numVerdicts]string{
	"executed", "replayed", "in_progress", "reused", "key_missing", "key_invalid",
	"no_key", "store_unavailable", "store_full", "failed_open", "refused",
	"key_expired", "first_sent_invalid", "outcome_unknown", "fenced",
}

func (v Verdict) String() string {
	if v >= numVerdicts {
		return "unknown"
	}
	return verdictNames[v]
}

// Exchange is one call as its entry point carries it: an entry point writes
// only this translation. Serve calls its methods on the call's goroutine,
// each at most once, in the order listed; Pass replaces Run, StandIn and
// Answer for a call that runs unprotected.
type Exchange interface {
	// Key returns the call's key, read with idemkey.ParseKey; ok is false
	// without one. An error answers KeyInvalid, and never quotes the key.
	Key() (key string, ok bool, err error)
	// FirstSent returns the values of the transport's first-sent field, or a
	// broker's timestamp formatted with idemkey.FormatDate.
	FirstSent() []string
	// FirstRegion returns the values of the transport's first-region field
	// (idemkey.FirstRegionHeader), read only by an engine WithRegion; none
	// for a transport that has no such field.
	FirstRegion() []string
	Attempt() Attempt
	// Fingerprint returns the request's fingerprint. An error is answered
	// (Refused) as it is, so it must be one of the transport's own.
	Fingerprint(ctx context.Context) (store.Fingerprint, error)
	// Run runs the handler with ctx, whose key the call holds.
	Run(ctx context.Context) HandlerResult
	// StandIn is the short error (at most store.SmallOutcome bytes)
	// recorded and answered in place of a result that cannot be recorded.
	StandIn(why error) []byte
	// Pass runs the handler unprotected (NoKey, FailedOpen) and answers.
	Pass(ctx context.Context) (code int)
	// Answer answers the call as a says. The metrics and hooks run after it,
	// before the entry point hands the answer over. Answer and Pass return
	// the transport's code.
	Answer(ctx context.Context, a Answer) (code int)
}

// Attempt is a call's place among its attempts.
type Attempt struct {
	// Retried is true for a later attempt (grpc-previous-rpc-attempts, a
	// redelivery): its record is read first (store.Finder).
	Retried bool
	// Last is true when no attempt follows: a key in progress elsewhere is
	// waited for up to the longest lease, so as to take it over.
	Last bool
}

// HandlerResult is what Exchange.Run returns.
type HandlerResult struct {
	// Record is the entry point's encoding of the result, replayed to retries.
	Record []byte
	// Release frees the key rather than record: a retry runs the handler again.
	Release bool
	// KeepWrites is true for a success: in atomic mode the handler's writes
	// commit with the record; a recorded error keeps only the record.
	KeepWrites bool
	// Unrecordable is why the result cannot be recorded (logged: it must not
	// quote the reply); StandIn is recorded in its place.
	Unrecordable error
}

// Answer is how Serve asks an entry point to answer a call.
type Answer struct {
	// Verdict is what to answer: Executed (the handler's result, or the
	// stand-in), Replayed (Outcome), or one of idemkey's own answers.
	Verdict Verdict
	// Err is why the call was refused: Exchange.Key's or Fingerprint's
	// error, a *FirstSentError, or the TenantFunc's error.
	Err error
	// Tenant is true when Err is the TenantFunc's refusal, answered as the
	// entry point answers those (gRPC: Err as it is; HTTP: 401).
	Tenant bool
	// Outcome is the record to replay, for Replayed; do not modify it.
	Outcome []byte
	// StandIn, for Executed, is why Exchange.StandIn is answered in place of
	// the handler's result; nil answers the result.
	StandIn error
	// RetryAfter is the wait asked of a retry, for InProgress and StoreFull.
	RetryAfter time.Duration
	// Unopened is true, for StoreUnavailable, when the key's record does not
	// open: no redelivery will open it, unlike a store that failed for now.
	Unopened bool
	// Expires is until when the key is honoured (the record's creation plus
	// the retention, on the store's clock); zero sends no expiry.
	Expires time.Time
}

// Serve runs one call of op through the request path (docs/request-path.md),
// answers it, and runs the metrics and hooks.
func (e *Engine) Serve(ctx context.Context, op *Operation, x Exchange) {
	c := e.newCall(op)
	c.end(ctx, c.serve(ctx, x))
}

func (c *call) serve(ctx context.Context, x Exchange) int {
	r, code, ok := c.read(ctx, x)
	if !ok {
		return code
	}
	return c.serveRequest(ctx, x, r)
}

// serveRequest serves a call whose request read has read.
func (c *call) serveRequest(ctx context.Context, x Exchange, r request) int {
	c.start(ctx, r)
	switch c.Verdict {
	case Executed:
		return c.run(ctx, x)
	case FailedOpen:
		return c.pass(c.contextFor(ctx), x)
	}
	return x.Answer(ctx, c.answerOf())
}

// read reads the call's request. If ok is false, the call was answered
// already, with code.
func (c *call) read(ctx context.Context, x Exchange) (r request, code int, ok bool) {
	key, ok, err := x.Key()
	switch {
	case err != nil:
		c.Verdict = KeyInvalid
		return r, x.Answer(ctx, Answer{Verdict: KeyInvalid, Err: err}), false
	case !ok && c.op.keyRequired:
		c.Verdict = KeyMissing
		return r, x.Answer(ctx, Answer{Verdict: KeyMissing}), false
	case !ok:
		c.Verdict = NoKey
		return r, c.pass(ctx, x), false
	}
	firstSent, err := c.e.firstSent(x.FirstSent())
	if err != nil {
		c.Verdict = FirstSentInvalid
		return r, x.Answer(ctx, Answer{Verdict: FirstSentInvalid, Err: err}), false
	}
	var firstRegion string
	if c.e.opts.region != "" {
		if firstRegion, err = firstRegionOf(x.FirstRegion()); err != nil {
			c.Verdict = FirstSentInvalid
			return r, x.Answer(ctx, Answer{Verdict: FirstSentInvalid, Err: err}), false
		}
	}
	tenant, err := c.tenantOf(ctx, x)
	if err != nil {
		return r, x.Answer(ctx, Answer{Verdict: Refused, Err: err, Tenant: true}), false
	}
	fp, err := x.Fingerprint(ctx)
	if err != nil {
		return r, x.Answer(ctx, Answer{Verdict: Refused, Err: err}), false
	}
	att := x.Attempt()
	return request{Tenant: tenant, Key: key, Fingerprint: fp, Retried: att.Retried, FirstSent: firstSent, FirstRegion: firstRegion, last: att.Last}, 0, true
}

func (c *call) pass(ctx context.Context, x Exchange) int {
	ctx, cancel := c.op.timed(ctx)
	defer cancel()
	return x.Pass(ctx)
}

// answerOf is the Answer of the call's verdict, for a call whose handler
// did not run, or whose record another call's superseded.
func (c *call) answerOf() Answer {
	a := Answer{Verdict: c.Verdict, RetryAfter: c.RetryAfter, Expires: c.Expires, Unopened: c.unopened}
	if c.Verdict == Fenced { // to the caller, a key in progress in its first region
		a.Verdict = InProgress
	}
	if c.Verdict == Replayed {
		a.Outcome = c.Outcome
	}
	if c.Verdict == FirstSentInvalid { // call.start's own check, which read's makes unlikely
		a.Err = &FirstSentError{"it lies in the future, beyond the clock skew allowed"}
	}
	return a
}

// run runs the handler of a call that holds its key, records its outcome
// or releases the key, and answers. In atomic mode only a success keeps the
// handler's writes.
func (c *call) run(ctx context.Context, x Exchange) int {
	defer c.abandon(ctx) // the handler panicked: let a retry run again; the panic goes on
	out := c.runHandler(ctx, x)
	v, forget := c.stepVerdict()
	if v != Executed {
		c.release(ctx)
		c.stepEnded(v)
		return x.Answer(ctx, c.answerOf())
	}
	if out.Unrecordable != nil {
		c.log(ctx, slog.LevelError, "outcome cannot be recorded; a short error is recorded instead", out.Unrecordable)
		return c.recordInstead(ctx, x, out.Unrecordable)
	}
	if out.Release {
		if forget {
			c.forgetSteps(ctx)
		}
		c.release(ctx)
		return x.Answer(ctx, Answer{Verdict: Executed})
	}
	switch err := c.record(ctx, out.Record, out.KeepWrites); {
	case errors.Is(err, ErrTooLarge), errors.Is(err, store.ErrFull):
		return c.recordInstead(ctx, x, err)
	case errors.Is(err, errSuperseded):
		return x.Answer(ctx, c.answerOf())
	case err != nil:
		return x.Answer(ctx, Answer{Verdict: StoreUnavailable})
	}
	return x.Answer(ctx, Answer{Verdict: Executed, Expires: c.Expires})
}

// runHandler runs the handler under its timeout, renewing a two-phase
// lease while it runs.
func (c *call) runHandler(ctx context.Context, x Exchange) HandlerResult {
	hctx, cancel := c.handlerContext(ctx)
	defer cancel()
	if r := c.running; r != nil && c.tx == nil && c.e.renewer != nil {
		r.startRenewal(c.lease, c.leaseEnd)
		defer func() { c.leaseEnd = r.stopRenewal() }()
	}
	return x.Run(hctx)
}

// recordInstead records the stand-in of a result that cannot be recorded:
// the handler has run, so its key must not be released; if even the
// stand-in cannot be recorded, the key stays in progress until its lease
// ends. Only in atomic mode, where a failed commit undoes the handler's
// writes, is the answer then StoreUnavailable.
func (c *call) recordInstead(ctx context.Context, x Exchange, why error) int {
	a := Answer{Verdict: Executed, StandIn: why}
	switch err := c.record(ctx, x.StandIn(why), false); {
	case errors.Is(err, errSuperseded):
		return x.Answer(ctx, c.answerOf())
	case err != nil && c.inTx():
		return x.Answer(ctx, Answer{Verdict: StoreUnavailable})
	case err == nil:
		a.Expires = c.Expires
	}
	return x.Answer(ctx, a)
}

// ServeBatch serves xs as Serve serves each, deciding them together in one
// round trip, and in atomic mode one commit, where the store can. A call the
// batch cannot finish (a repeated key, a used-up lease, a failed
// transaction, a last attempt found in progress) is served on its own after
// it: its Exchange may be asked twice. In atomic mode no call is answered
// before the commit.
func (e *Engine) ServeBatch(ctx context.Context, op *Operation, xs []Exchange) {
	if !e.canBatch(op) || len(xs) < 2 {
		for _, x := range xs {
			e.Serve(ctx, op, x)
		}
		return
	}
	for start := 0; start < len(xs); start += MaxBatch {
		e.serveBatch(ctx, op, xs[start:min(start+MaxBatch, len(xs))])
	}
}

func (e *Engine) serveBatch(ctx context.Context, op *Operation, xs []Exchange) {
	reqs := make([]request, 0, len(xs))
	at := make([]Exchange, 0, len(xs)) // the exchange of each request
	for _, x := range xs {
		c := e.newCall(op)
		r, code, ok := c.read(ctx, x)
		if !ok {
			c.end(ctx, code)
			continue
		}
		if e.fenced(r) { // never reserved with the batch: served on its own
			c.end(ctx, c.serveRequest(ctx, x, r))
			continue
		}
		reqs, at = append(reqs, r), append(at, x)
	}
	b := e.startBatch(ctx, op, reqs)
	defer b.abandon(ctx) // a panic rolls the batch back, then propagates
	codes := make([]int, len(at))
	pending := make([]*Answer, len(at)) // atomic: answered once the commit says
	for j, x := range at {
		c := &b.Calls[j]
		switch {
		case b.alone(j), c.Verdict == InProgress && reqs[j].last:
			// Served on its own after the batch: a last attempt waits there.
		case c.Verdict == Executed && !op.atomic:
			if b.ready(ctx, j) {
				codes[j] = c.run(ctx, x)
			}
		case c.Verdict == Executed:
			pending[j] = b.run(ctx, j, x)
		default:
			codes[j] = x.Answer(ctx, c.answerOf())
		}
	}
	err := b.commit(ctx)
	for j, x := range at {
		c := &b.Calls[j]
		switch {
		case b.alone(j), c.Verdict == InProgress && reqs[j].last:
			e.Serve(ctx, op, x) // counted there: this call is not
			continue
		case pending[j] != nil && err != nil && b.state[j] == batchStaged:
			// The commit failed, or its fate is unknown: a retry finds out.
			codes[j] = x.Answer(ctx, Answer{Verdict: StoreUnavailable})
		case pending[j] != nil:
			codes[j] = x.Answer(ctx, *pending[j])
		}
		c.end(ctx, codes[j])
	}
}

// run runs Executed call i of an atomic batch in its transaction and stages
// its outcome for the commit, or undoes its writes; the answer waits for it.
func (b *batch) run(ctx context.Context, i int, x Exchange) *Answer {
	c := &b.Calls[i]
	out := func() HandlerResult {
		hctx, cancel := b.op.timed(ctx)
		defer cancel()
		return x.Run(b.contextFor(hctx, i))
	}()
	v, forget := c.stepVerdict()
	if v != Executed {
		b.release(ctx, i)
		c.stepEnded(v)
		a := c.answerOf()
		return &a
	}
	if out.Release {
		if forget {
			c.forgetSteps(ctx)
		}
		b.release(ctx, i)
		return &Answer{Verdict: Executed}
	}
	record, why := out.Record, out.Unrecordable
	if why != nil {
		c.log(ctx, slog.LevelError, "outcome cannot be recorded; a short error is recorded instead", why)
		record = x.StandIn(why)
	}
	err := b.record(ctx, i, record, out.KeepWrites && why == nil)
	if errors.Is(err, ErrTooLarge) && why == nil {
		why = err // nothing was done: record the stand-in in its place
		err = b.record(ctx, i, x.StandIn(why), false)
	}
	if err != nil {
		b.release(ctx, i)
		return &Answer{Verdict: StoreUnavailable}
	}
	return &Answer{Verdict: Executed, StandIn: why, Expires: c.Expires}
}
