package consumer

import (
	"context"

	"github.com/idemkey/idemkey/engine"
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
// after the others (engine.ServeBatch). On another store each message is
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
// bounds each handler's run, and the read that decides the batch. The last
// delivery of a message that met a failing store is held, after the batch,
// until the store answers, as Process holds it.
func (c *Consumer) ProcessBatch(ctx context.Context, ds []Delivery, h BatchHandler) []Result {
	xs := make([]*exchange, len(ds))
	exchanges := make([]engine.Exchange, len(ds))
	for i, d := range ds {
		xs[i] = &exchange{c: c, d: d, h: func(ctx context.Context) error { return h(ctx, i) }}
		exchanges[i] = xs[i]
	}
	c.eng.ServeBatch(ctx, c.op, exchanges)
	results := make([]Result, len(ds))
	for i, x := range xs {
		results[i] = x.res
		if ds[i].Last && x.res.Outcome == StoreFailed {
			// Its last delivery is held until the store answers, on its
			// own, as Process holds one.
			results[i] = c.Process(ctx, ds[i], x.h)
		}
	}
	return results
}
