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
// On a store that decides batches (store/postgres), one round trip reads
// the record of every id and takes the free ones; the handlers then run
// one after another, in the order of ds. In atomic mode they run in one
// transaction, each message's writes apart (a savepoint each), and every
// record commits with them in one commit; in two-phase mode each message is
// recorded or released as its handler returns, and one whose lease the
// handlers before it used up is processed on its own after the others. On
// another store each message is processed on its own, as Process does. An
// id that an earlier message of the batch has is decided after the batch; a
// batch that loses a race on one of its ids, or whose transaction fails
// before its commit, commits nothing, and its messages are processed again
// one at a time. At most engine.MaxBatch messages are decided together. The
// last delivery of a message that met a failing store is held after the
// batch, as Process holds it. docs/consumers.md ("Batches in detail") has
// the rest.
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
		// A last delivery that met a failing store is held, on its own
		// after the batch, as Process holds one.
		results[i] = c.hold(ctx, ds[i], x.h, x.res)
	}
	return results
}
