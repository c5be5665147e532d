package engine

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Verdict is what became of a call: the value of the idemkey.outcome
// attribute of its metrics, its span and its Debug log line.
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
	FirstSentInvalid                // the first-sent time is malformed, or in the future: not run
	numVerdicts
)

var verdictNames = [numVerdicts]string{
	"executed", "replayed", "in_progress", "reused", "key_missing", "key_invalid",
	"no_key", "store_unavailable", "store_full", "failed_open", "refused",
	"key_expired", "first_sent_invalid",
}

func (v Verdict) String() string {
	if v >= numVerdicts {
		return "unknown"
	}
	return verdictNames[v]
}

// Exchange is one call as its entry point carries it. Serve reads the call
// through it and answers through it, so that an entry point writes only its
// translation: where the key, the first-sent time and the fingerprint come
// from, how the handler runs and its result is encoded, and how each answer
// is written. Serve calls its methods on the call's goroutine, each at most
// once, in the order they are listed, except that Pass replaces Run, StandIn
// and Answer for a call that runs unprotected.
type Exchange interface {
	// Key returns the call's idempotency key, read with idemkey.ParseKey;
	// ok is false when the call has none. An error (a malformed key, one
	// sent twice) answers KeyInvalid, and never quotes the key.
	Key() (key string, ok bool, err error)
	// FirstSent returns the values of the transport's first-sent field
	// (idemkey.FirstSentMetadata, idemkey.FirstSentHeader), or the time a
	// broker stamped a message with, formatted with idemkey.FormatDate;
	// none if the call does not say.
	FirstSent() []string
	// Attempt tells where the call stands among its attempts.
	Attempt() Attempt
	// Fingerprint returns the fingerprint of the call's request. An error
	// refuses the call: it is answered (Refused) as it is, so it must be
	// one of the transport's own.
	Fingerprint(ctx context.Context) (store.Fingerprint, error)
	// Run runs the handler with ctx, whose key the call holds, and returns
	// what to record of its result.
	Run(ctx context.Context) HandlerResult
	// StandIn is the short error recorded, and answered, in place of a
	// result that cannot be recorded (why: ErrTooLarge, store.ErrFull, or
	// HandlerResult.Unrecordable): at most store.SmallOutcome bytes.
	StandIn(why error) []byte
	// Pass runs the handler with ctx unprotected (NoKey, FailedOpen),
	// answers with its result, and returns the transport's code of it.
	Pass(ctx context.Context) (code int)
	// Answer answers the call as a says, and returns the transport's code
	// of the answer, for the metrics and the hooks, which run after it and
	// before the entry point hands the answer over.
	Answer(ctx context.Context, a Answer) (code int)
}

// Attempt is what a transport tells of a call's place among its attempts.
type Attempt struct {
	// Retried is true for a later attempt (gRPC's grpc-previous-rpc-attempts,
	// a broker's redelivery): its record is read first, on a store that
	// implements store.Finder.
	Retried bool
	// Last is true when no attempt follows (a message's last delivery): a
	// key in progress elsewhere is waited for up to the longest lease, so
	// as to take it over, rather than for WithInProgressWait.
	Last bool
}

// HandlerResult is what Exchange.Run returns of the handler's result.
type HandlerResult struct {
	// Record is the entry point's encoding of the result, recorded and
	// replayed to every retry.
	Record []byte
	// Release is true for a result that is not recorded (a released code):
	// the key is released, and a retry runs the handler again.
	Release bool
	// KeepWrites is true for a success: in atomic mode the handler's writes
	// commit with the record; a recorded error keeps only the record.
	KeepWrites bool
	// Unrecordable is why the result cannot be recorded (it is logged, so
	// it must not quote the reply): StandIn is recorded in its place.
	Unrecordable error
}

// Answer is how Serve asks an entry point to answer a call.
type Answer struct {
	// Verdict is what to answer: Executed (the handler's result, or the
	// stand-in of StandIn), Replayed (Outcome), or idemkey's own answer of
	// InProgress, Reused, KeyMissing, KeyInvalid, StoreUnavailable,
	// StoreFull, Expired, FirstSentInvalid or Refused.
	Verdict Verdict
	// Err is why the call was refused: Exchange.Key's or Fingerprint's
	// error, a *FirstSentError, or the TenantFunc's error (Tenant).
	Err error
	// Tenant is true when Err is the TenantFunc's refusal of the caller, to
	// answer as the entry point answers those (gRPC and Connect: Err as it
	// is; HTTP: 401), rather than one of the entry point's own.
	Tenant bool
	// Outcome is the record to replay, for Replayed. It must not be
	// modified.
	Outcome []byte
	// StandIn is, for Executed, why the stand-in (Exchange.StandIn with
	// it) is answered in place of the handler's result; nil answers the
	// handler's result.
	StandIn error
	// RetryAfter is how long to wait before a retry, for InProgress and
	// StoreFull.
	RetryAfter time.Duration
	// Unopened is true, for StoreUnavailable, when the key's record does not
	// open (a sealed record the key ring cannot open): the store answers,
	// and no retry of the call opens it, as a broker's redelivery could
	// wait for a store that failed for now.
	Unopened bool
	// Expires is until when the call's key is honoured: its record's
	// creation plus the retention, on the store's clock, the same for every
	// answer about the key; zero (the store cannot say) sends no expiry.
	Expires time.Time
}

// Serve runs one call of op through the request path: the key, whether one
// is required, the first-sent time, the tenant, the fingerprint; the
// reservation, a wait for a duplicate; the handler, its record or release,
// or the stand-in of a result that cannot be recorded; the answer, and then
// the metrics and hooks. Every entry point serves its calls with it.
func (e *Engine) Serve(ctx context.Context, op *Operation, x Exchange) {
	c := e.newCall(op)
	c.end(ctx, c.serve(ctx, x))
}

// serve is Serve up to the code of the call's answer.
func (c *call) serve(ctx context.Context, x Exchange) int {
	r, code, ok := c.read(ctx, x)
	if !ok {
		return code
	}
	c.start(ctx, r)
	switch c.Verdict {
	case Executed:
		return c.run(ctx, x)
	case FailedOpen:
		return c.pass(c.contextFor(ctx), x)
	}
	return x.Answer(ctx, c.answerOf())
}

// read reads the request of the call x carries. If ok is false, the call is
// answered already, with code: it had no key (and ran unprotected, or was
// refused), or its key, first-sent time, tenant or request was refused.
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
	tenant, err := c.tenantOf(ctx, x)
	if err != nil {
		return r, x.Answer(ctx, Answer{Verdict: Refused, Err: err, Tenant: true}), false
	}
	fp, err := x.Fingerprint(ctx)
	if err != nil {
		return r, x.Answer(ctx, Answer{Verdict: Refused, Err: err}), false
	}
	att := x.Attempt()
	return request{Tenant: tenant, Key: key, Fingerprint: fp, Retried: att.Retried, FirstSent: firstSent, last: att.Last}, 0, true
}

// pass runs the handler unprotected, under the operation's HandlerTimeout.
func (c *call) pass(ctx context.Context, x Exchange) int {
	ctx, cancel := c.op.timed(ctx)
	defer cancel()
	return x.Pass(ctx)
}

// answerOf is the Answer of the call's verdict, for a call whose handler
// did not run, or whose record another call's superseded.
func (c *call) answerOf() Answer {
	a := Answer{Verdict: c.Verdict, RetryAfter: c.RetryAfter, Expires: c.Expires, Unopened: c.unopened}
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
// handler's writes: a recorded error, or a result that could not be
// recorded, undoes them.
func (c *call) run(ctx context.Context, x Exchange) int {
	defer c.abandon(ctx) // the handler panicked: let a retry run again; the panic goes on
	out := c.runHandler(ctx, x)
	if out.Unrecordable != nil {
		c.log(ctx, slog.LevelError, "outcome cannot be recorded; a short error is recorded instead", out.Unrecordable)
		return c.recordInstead(ctx, x, out.Unrecordable)
	}
	if out.Release {
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

// runHandler is x.Run with the handler's context, under the operation's
// HandlerTimeout.
func (c *call) runHandler(ctx context.Context, x Exchange) HandlerResult {
	hctx, cancel := c.handlerContext(ctx)
	defer cancel()
	return x.Run(hctx)
}

// recordInstead records the stand-in of a result that cannot be recorded:
// the handler has run, so its key must not be released. The caller gets it
// too, as every retry will; if even it cannot be recorded, the key stays in
// progress until its lease ends. Only in atomic mode, where a failed commit
// undoes the handler's writes, is the answer StoreUnavailable.
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

// ServeBatch serves xs, calls of op, as Serve serves each, and decides them
// together where the store can (store.BatchAtomic for an atomic operation,
// store.BatchReserver for a two-phase one): a message consumer that takes
// its messages in batches dedups a batch in one round trip of the store's,
// and in atomic mode commits it with one commit (consumer.ProcessBatch
// lists what a batch does differently). A call the batch cannot finish (a key an earlier
// call of the batch has, one past MaxBatch, a two-phase call whose lease the
// handlers before it used up, an atomic batch whose transaction failed, the
// last attempt of a call found in progress elsewhere) is served on its own
// after the batch, from Exchange.Key on: its Exchange may be asked twice. In
// atomic mode no call is answered before the batch's commit has said how it
// ends. ctx bounds the store's operations; each handler runs under the
// operation's HandlerTimeout.
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

// serveBatch is ServeBatch for at most MaxBatch calls.
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
			// Decided on its own after the batch, which a last attempt in
			// progress elsewhere waits in.
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

// run runs the handler of Executed call i of an atomic batch in the batch's
// transaction, and stages its outcome for the commit, or undoes its writes:
// it returns the call's answer once the commit has succeeded.
func (b *batch) run(ctx context.Context, i int, x Exchange) *Answer {
	c := &b.Calls[i]
	out := func() HandlerResult {
		hctx, cancel := b.op.timed(ctx)
		defer cancel()
		return x.Run(b.contextFor(hctx, i))
	}()
	if out.Release {
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
