package consumer

import (
	"context"
	"crypto/sha256"
	"errors"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// BatchHandler processes message i of a batch (ProcessBatch). In atomic mode
// ctx carries the batch's transaction: its writes commit with the message's
// record, and are undone alone if the message fails. Its error decides what
// becomes of the message, as a Handler's does.
type BatchHandler func(ctx context.Context, i int) error

// ProcessBatch decides what to do with each of ds, as Process decides one,
// and returns their Results in the same order; h(ctx, i) processes ds[i].
// Act on the Results only once it has returned: in atomic mode nothing of
// the batch is durable before.
//
// In atomic mode, on a store that decides batches (store/postgres), the
// batch is deduplicated in one round trip of the store's: one statement
// reads the record of every id and takes those that are free. The handlers
// of the messages to process then run one after another, in the order of
// ds, in one transaction, each message's writes apart from the others': a
// message that fails for good has its writes undone and its failure
// recorded, one that fails for now has its writes undone and is
// redelivered, and the others' writes commit, with every record, in one
// commit. So each message takes effect exactly once, as one at a time. A
// message answers as it would one at a time: a duplicate, one in progress
// elsewhere, a refused one; the last delivery of a message in progress
// elsewhere waits for it (after the batch's commit).
//
// In two-phase mode, on a store that reserves batches (store/postgres), one
// statement reserves every id of the batch that is free, and reads the
// record of every other. The handlers of the messages to process then run
// one after another, in the order of ds, each recorded or released as soon
// as it returns, as Process does: a batch of n new messages costs n+1
// round trips of the store's instead of 2n. Each id is reserved with the
// lease of one message, as Process reserves it, so that a crash holds no id
// longer: once the handlers before a message have taken so long that less
// of its lease is left than its handler may take (WithHandlerTimeout, plus
// a little), its id is released and the message is processed on its own
// after the others (engine.Batch.Ready). On another store each message is
// processed on its own, in order, as Process does.
//
// What a batch does differently:
//   - An id that an earlier message of the batch has is decided on its own
//     after the batch (in atomic mode, after its commit): a duplicate of
//     the earlier message, if that was recorded.
//   - At most engine.MaxBatch (64) messages are decided together, and a
//     longer ds is processed in several batches.
//   - In atomic mode, a message found in progress elsewhere is answered
//     Busy at once, as Process does, but its id stays held for the batch's
//     whole run.
//   - In atomic mode, if another consumer recorded an id of the batch
//     between the batch's read and its commit (a rare race), or the batch's
//     transaction fails before its commit (its connection lost, a handler
//     that ended it), nothing of the batch is committed, and each message
//     whose handler ran is processed again on its own: its handler runs a
//     second time, after a first run whose writes were undone.
//   - In atomic mode, a batch holds one connection of the store for its
//     whole run, and its messages' ids, however many.
//
// ctx bounds the store's operations and the handlers; WithHandlerTimeout
// bounds each handler's run, and the read that decides the batch.
func (c *Consumer) ProcessBatch(ctx context.Context, ds []Delivery, h BatchHandler) []Result {
	results := make([]Result, len(ds))
	if !c.eng.CanBatch(c.op) || len(ds) < 2 {
		for i := range ds {
			results[i] = c.Process(ctx, ds[i], func(ctx context.Context) error { return h(ctx, i) })
		}
		return results
	}
	for start := 0; start < len(ds); start += engine.MaxBatch {
		end := min(start+engine.MaxBatch, len(ds))
		c.processBatch(ctx, ds[start:end], results[start:end], func(ctx context.Context, i int) error { return h(ctx, start+i) })
	}
	return results
}

// processBatch is ProcessBatch for at most engine.MaxBatch messages.
func (c *Consumer) processBatch(ctx context.Context, ds []Delivery, results []Result, h BatchHandler) {
	one := func(i int) Handler { return func(ctx context.Context) error { return h(ctx, i) } }
	reqs := make([]engine.Request, 0, len(ds))
	at := make([]int, 0, len(ds)) // the message of each request
	for i, d := range ds {
		if d.ID == "" || len(d.ID) > idemkey.MaxKeyLen {
			results[i] = c.Process(ctx, d, one(i)) // refused, without the store
			continue
		}
		reqs = append(reqs, d.request())
		at = append(at, i)
	}
	sctx, cancel := c.timed(ctx) // as in Process: it bounds the read, and sets the lease
	defer cancel()
	b := c.eng.StartBatch(sctx, c.op, reqs)
	defer b.Abandon(ctx) // a panic rolls the batch back, then propagates
	staged := make([]bool, len(reqs))
	for j, i := range at {
		call := &b.Calls[j]
		switch {
		case b.Alone(j):
		case call.Verdict == engine.Executed && !c.op.Atomic():
			if b.Ready(ctx, j) {
				results[i] = c.runTimed(ctx, call, ds[i], one(i))
			}
		case call.Verdict == engine.Executed:
			results[i], staged[j] = c.runInBatch(ctx, b, j, ds[i], one(i))
		default:
			results[i] = c.answer(ctx, ds[i], answerOf(call), Result{})
		}
	}
	err := b.Commit(ctx)
	for j, i := range at {
		call, d := &b.Calls[j], ds[i]
		switch {
		case b.Alone(j), d.Last && results[i].Outcome == Busy:
			// Decided on its own, as Process decides it, which counts it
			// (the batch's call is not): a last delivery in progress
			// elsewhere then waits for it.
			results[i] = c.Process(ctx, d, one(i))
			continue
		case staged[j] && err != nil:
			// The commit failed, or its fate is unknown. The redelivery
			// finds out: a committed record drops it.
			results[i] = Result{Outcome: StoreUnavailable, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}
		}
		results[i] = c.lastDelivery(ctx, d, results[i])
		call.End(ctx, int(results[i].Action))
	}
}

// request is what the engine is asked for d, in a batch.
func (d Delivery) request() engine.Request {
	r := engine.Request{Tenant: d.Tenant, Key: d.ID, Fingerprint: sha256.Sum256(d.Body), Retried: d.Redelivered}
	if !d.Sent.After(time.Now()) {
		r.FirstSent = d.Sent
	}
	return r
}

// answerOf is the engine.Answer of a call of a batch that the batch
// decided without running its handler, or whose record another call's
// superseded.
func answerOf(call *engine.Call) engine.Answer {
	return engine.Answer{Verdict: call.Verdict, Outcome: call.Outcome, RetryAfter: call.RetryAfter, Expires: call.Expires}
}

// runInBatch runs h for message j of batch b, which holds its id, and ends
// it by h's error, as Process does one message: staged reports that its
// outcome is to be recorded at the batch's commit.
func (c *Consumer) runInBatch(ctx context.Context, b *engine.Batch, j int, d Delivery, h Handler) (res Result, staged bool) {
	err := func() error {
		hctx, cancel := c.timed(ctx)
		defer cancel()
		return h(b.Context(hctx, j))
	}()
	res, out := c.ran(d, err)
	if out.Release {
		b.Release(ctx, j)
		return res, false
	}
	if rerr := b.Record(ctx, j, out.Record, out.KeepWrites); rerr != nil {
		b.Release(ctx, j) // a record too large leaves the message running
		return Result{Outcome: StoreUnavailable, Action: Nak, Delay: c.backoff(d.Attempt), Err: rerr}, false
	}
	return res, true
}

// runTimed runs h, under the handler timeout, for a message of a two-phase
// batch whose id the batch reserved, and records or releases it by h's
// error, as Process does.
func (c *Consumer) runTimed(ctx context.Context, call *engine.Call, d Delivery, h Handler) Result {
	ctx, cancel := c.timed(ctx)
	defer cancel()
	defer call.Abandon(ctx) // a panic releases the id, then propagates
	res, out := c.ran(d, h(call.Context(ctx)))
	if out.Release {
		call.Release(ctx)
		return res
	}
	switch err := call.Record(ctx, out.Record, out.KeepWrites); {
	case err == nil:
	case errors.Is(err, store.ErrFull):
		// As Process answers a stand-in: acknowledged all the same.
		c.Warn(ctx, "no room to record a processed message; it is acknowledged all the same", err)
	default: // ErrTooLarge, which a record of a few bytes never meets
		return Result{Outcome: StoreUnavailable, Action: Nak, Delay: c.backoff(d.Attempt), Err: err}
	}
	return res
}
