package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// MaxBatch is the most calls ServeBatch decides together; it serves a
// larger batch in parts. Each call of a batch that writes takes a
// subtransaction, and past 64 PostgreSQL slows the whole database down
// (docs/postgres.md).
const MaxBatch = 64

// canBatch reports whether the store decides calls of op together
// (store.BatchAtomic, store.BatchReserver).
func (e *Engine) canBatch(op *Operation) bool {
	if op.atomic {
		return e.batchStore != nil
	}
	return e.batchReserver != nil
}

// batch is a batch of calls of one operation, decided together in one round
// trip of the store's; in atomic mode it is one transaction, committed with
// one commit. serveBatch drives it: startBatch, abandon deferred, run (or
// call.run) for each Executed call, commit, then each call alone is served
// with Serve and the others answered. The handlers run one after another on
// the caller's goroutine; each call's writes are its own, undone alone when
// it is released or records an error.
//
// In two-phase mode each Executed call runs as after call.start, once ready
// says it may; its outcome is durable when call.record returns, and commit
// does nothing.
type batch struct {
	// Calls are the batch's calls, one per request, in order, each with its
	// Verdict as call.start would set it without waiting (unset if alone).
	Calls []call
	e     *Engine
	op    *Operation
	tx    store.BatchTx // nil when the batch acquired no key
	lease time.Duration // each call's
	idx   []int         // each call's index among the store's reservations, or -1
	state []batchState
	size  []int // each staged call's outcome size, for the metrics
	done  bool  // committed or rolled back
}

type batchState uint8

const (
	batchIdle    batchState = iota // decided, and its handler not run yet (if it runs)
	batchAlone                     // to be served on its own, with Serve
	batchRunning                   // its handler runs: contextFor was called
	batchStaged                    // its outcome is to be recorded at commit
	batchEnded                     // released, or its record failed
)

// startBatch decides reqs as call.start decides each, in one round trip
// that reads every key and takes those that are free. A call found in
// progress is answered InProgress at once. A store's error answers every
// call as a store failure; a store.PartialError only the calls it names,
// the others going on as if the batch had succeeded (in atomic mode in the
// transaction, which holds only theirs). A request is left alone, served
// after the batch, if an earlier request has its key (its answer depends on
// how that one ends), if it comes after MaxBatch, or if op cannot batch.
func (e *Engine) startBatch(ctx context.Context, op *Operation, reqs []request) *batch {
	b := &batch{Calls: make([]call, len(reqs)), e: e, op: op, idx: make([]int, len(reqs)),
		state: make([]batchState, len(reqs)), size: make([]int, len(reqs))}
	rs := make([]store.Reservation, 0, min(len(reqs), MaxBatch))
	seen := make(map[store.Key]struct{}, len(reqs))
	lease := e.lease(ctx, op)
	b.lease = lease
	for i, r := range reqs {
		c := &b.Calls[i]
		*c = e.newCall(op)
		fp := c.identify(r)
		b.idx[i] = -1
		if !c.checkFirstSent(r.FirstSent) {
			continue
		}
		if _, repeated := seen[c.key]; repeated || len(rs) == MaxBatch || !e.canBatch(op) {
			b.state[i] = batchAlone
			continue
		}
		seen[c.key] = struct{}{}
		b.idx[i] = len(rs)
		c.lease, c.leaseEnd = lease, c.began.Add(lease) // the store's clock starts it later, never earlier
		rs = append(rs, e.roomFor(store.Reservation{
			Key:         c.key,
			Fingerprint: fp,
			Lease:       lease,
			Retention:   op.retention,
			MaxOutcome:  e.opts.maxRecord,
			Partition:   c.partition,
		}))
	}
	if len(rs) == 0 {
		return b
	}
	var (
		res []store.Entry
		err error
	)
	if op.atomic {
		res, b.tx, err = e.beginBatch(ctx, rs)
	} else {
		res, err = e.reserveBatch(ctx, rs)
	}
	partial := partialOf(err, len(rs), len(res))
	for i := range b.Calls {
		j := b.idx[i]
		if j < 0 {
			continue
		}
		c := &b.Calls[i]
		callErr := err
		if partial != nil { // the others are decided as if the batch had succeeded
			callErr = nil
			if partial.Failed[j] {
				callErr = partial.Err
			}
		}
		var openErr error
		if callErr == nil {
			res[j], openErr = e.opened(rs[j].Key, &rs[j].Fingerprint, res[j])
		}
		switch {
		case errors.Is(callErr, store.ErrFull):
			c.Verdict, c.RetryAfter = StoreFull, e.opts.retryAfter
		case callErr != nil:
			c.storeFailed(ctx, "reserve", callErr)
			if !op.atomic && partial == nil && len(res) == len(rs) && res[j].State == store.Acquired {
				// A partial error that does not fit: the store took the key all
				// the same, and would hold it for a lease.
				c.token = res[j].Token
				c.release(ctx)
			}
		case openErr != nil:
			c.storeFailed(ctx, "reserve", openErr)
		case res[j].State == store.Acquired && c.stale && op.atomic:
			// Its key is the batch's until the batch ends, and nothing of
			// it is written: no one else runs it meanwhile.
			c.Verdict = Expired
		case res[j].State == store.Acquired && c.stale:
			c.Verdict, c.token = Executed, res[j].Token
			c.release(ctx)
			c.Verdict = Expired
		case res[j].State == store.Acquired:
			c.Verdict, c.fingerprint, c.Expires, c.token = Executed, rs[j].Fingerprint, res[j].Expires, res[j].Token
		default:
			c.answer(rs[j].Fingerprint, res[j])
		}
	}
	return b
}

// partialOf is err as a store.PartialError for a batch of n reservations
// answered with m entries, or nil: a plain error, or a partial one that does
// not fit the batch or names no error, fails every call.
func partialOf(err error, n, m int) *store.PartialError {
	var pe *store.PartialError
	if !errors.As(err, &pe) || pe.Err == nil || len(pe.Failed) != n || m != n {
		return nil
	}
	return pe
}

// scopeOperation is the operation in the scope of op's keys: "" under
// ScopeTenant, where a key spans operations and its fingerprints are
// bound to theirs (identify).
func (e *Engine) scopeOperation(op *Operation) string {
	if e.opts.scope == ScopeTenant {
		return ""
	}
	return op.name
}

// identify sets the call's key and parts, and returns the fingerprint it
// reserves with.
func (c *call) identify(r request) store.Fingerprint {
	scopeOp := c.e.scopeOperation(c.op)
	c.key = store.ScopeKey(r.Tenant, scopeOp, r.Key)
	c.partition = c.e.partitions.of(r.Tenant) // once per call, even when it waits and reserves again
	c.tenant, c.userKey = r.Tenant, r.Key
	c.started = true
	if scopeOp == "" {
		// A key shared across operations must never replay one operation's
		// reply to another, whatever a custom fingerprint leaves out.
		return bindOperation(c.op.name, r.Fingerprint)
	}
	return r.Fingerprint
}

// alone reports whether call i is to be served on its own after the batch:
// startBatch left it out, or the batch could not finish it. Nothing of a
// handler that ran in the batch was committed.
func (b *batch) alone(i int) bool { return b.state[i] == batchAlone }

// ready reports whether the handler of Executed call i of a two-phase
// batch may run now. The handlers before it used some of its lease; with
// less left than a handler may take, another run could take the key over
// meanwhile, so ready releases the key and the call is alone. In atomic
// mode the batch's transaction holds its keys: true.
func (b *batch) ready(ctx context.Context, i int) bool {
	c := &b.Calls[i]
	if b.op.atomic || c.Verdict != Executed || time.Until(c.leaseEnd) >= b.lease-min(leaseGrace, b.lease)/2 {
		return true
	}
	c.release(ctx)
	*c = call{e: c.e, op: c.op, began: c.began, Verdict: Refused} // as newCall left it
	b.state[i], b.idx[i] = batchAlone, -1
	return false
}

// contextFor is ctx for the handler of Executed call i: the call's parts
// for idemkey.DerivedKey, and the batch's transaction, in which the call's
// writes from now on are its own until record or release.
func (b *batch) contextFor(ctx context.Context, i int) context.Context {
	c := &b.Calls[i]
	ctx = idemkey.HandlerContext(ctx, c.tenant, b.op.name, c.userKey)
	if b.tx == nil || b.done || c.Verdict != Executed || b.state[i] != batchIdle {
		return ctx
	}
	b.state[i] = batchRunning
	return c.newRunning(b.tx.HandlerContext(ctx, b.idx[i]))
}

// record stages outcome for commit; with keepWrites false the handler's
// writes are undone first. Its error is ErrTooLarge (nothing was done:
// run records the stand-in), or nothing will be recorded for the call and
// its writes were undone, or the transaction failed and alone(i) is true.
func (b *batch) record(ctx context.Context, i int, outcome []byte, keepWrites bool) error {
	c := &b.Calls[i]
	if b.state[i] != batchRunning {
		return errors.New("idemkey: record of a call of a batch whose handler is not running")
	}
	if len(outcome) > b.e.opts.maxRecord {
		c.log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead",
			tooLarge(len(outcome), b.e.opts.maxRecord))
		return ErrTooLarge
	}
	b.state[i] = batchEnded
	size := len(outcome)
	outcome, err := b.e.sealOutcome(c.key, outcome)
	if err != nil {
		c.log(ctx, slog.LevelError, "the call's writes were undone and nothing is recorded for it", err)
		if relErr := b.tx.Release(ctx, b.idx[i]); relErr != nil {
			b.failed(ctx)
		}
		return err
	}
	if err := b.tx.Record(ctx, b.idx[i], outcome, keepWrites); err != nil {
		if !b.failed(ctx) {
			c.log(ctx, slog.LevelError, "the call's writes were undone and nothing is recorded for it", err)
		}
		return err
	}
	b.state[i], b.size[i] = batchStaged, size
	return nil
}

// release undoes call i's writes and records nothing: a retry runs it again.
func (b *batch) release(ctx context.Context, i int) {
	if b.state[i] != batchRunning {
		return
	}
	b.state[i] = batchEnded
	if err := b.tx.Release(ctx, b.idx[i]); err != nil && !b.failed(ctx) {
		b.Calls[i].log(ctx, slog.LevelWarn, "undoing the call's writes failed", err)
	}
}

// failed reports whether the batch's transaction has failed; if it just
// did, every call that holds its key in it is alone from now on.
func (b *batch) failed(ctx context.Context) bool {
	err := b.tx.Err()
	if err == nil {
		return false
	}
	n := 0
	for i := range b.Calls {
		if b.idx[i] >= 0 && b.Calls[i].Verdict == Executed && b.state[i] != batchAlone {
			b.state[i] = batchAlone
			n++
		}
	}
	if n > 0 {
		b.e.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey: the transaction of a batch failed before its commit; nothing of it was committed, and each of its calls is decided again on its own",
			slog.String("operation", b.op.name), slog.Int("calls", n), slog.Any("error", err))
	}
	return true
}

// commit records every staged outcome in one commit, ignoring ctx's
// cancellation. Its error is nil (all committed), errSuperseded (another
// call recorded a key first; nothing committed; staged calls are alone) or
// errBatchFailed (nothing, or perhaps everything, committed: a retry finds
// out).
func (b *batch) commit(ctx context.Context) error {
	if b.done || b.tx == nil {
		return nil
	}
	b.done = true
	for i := range b.Calls {
		if b.state[i] == batchRunning { // contextFor without record or release
			b.state[i] = batchEnded
			if err := b.tx.Release(ctx, b.idx[i]); err != nil {
				b.failed(ctx)
			}
		}
	}
	if b.tx.Err() != nil {
		b.tx.Rollback(ctx)
		return nil // every call whose handler ran is alone
	}
	err := b.e.commitBatch(ctx, b.tx)
	switch {
	case err == nil:
		for i := range b.Calls {
			if b.state[i] == batchStaged {
				b.e.obs.recorded(ctx, b.op, b.size[i])
				b.Calls[i].noteWrite(b.size[i], nil)
			}
		}
		return nil
	case errors.Is(err, store.ErrLeaseLost):
		n := 0
		for i := range b.Calls {
			if b.state[i] == batchStaged {
				b.state[i] = batchAlone
				n++
			}
		}
		b.e.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey: another call recorded a key of a batch first; nothing of the batch was committed, and each of its calls that ran is decided again on its own",
			slog.String("operation", b.op.name), slog.Int("calls", n), slog.Any("error", err))
		return errSuperseded
	}
	for i := range b.Calls {
		if b.state[i] == batchStaged {
			b.Calls[i].log(ctx, slog.LevelError, "the batch's commit failed; the call's writes and record were rolled back, or their fate is unknown, and a retry finds out", err)
		}
	}
	return fmt.Errorf("%w: %w", errBatchFailed, err)
}

// abandon, deferred, rolls the batch back if it was not committed (a handler
// panicked); in two-phase mode it releases the keys not yet ended.
func (b *batch) abandon(ctx context.Context) {
	if !b.op.atomic {
		for i := range b.Calls {
			if b.idx[i] >= 0 {
				b.Calls[i].abandon(ctx)
			}
		}
		return
	}
	if b.done || b.tx == nil {
		return
	}
	b.done = true
	if err := b.tx.Rollback(ctx); err != nil {
		b.e.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey: rolling a batch back failed; the database rolls back when it closes the connection",
			slog.String("operation", b.op.name), slog.Any("error", err))
	}
}
