package consumer

import (
	"context"

	"github.com/idemkey/idemkey/engine"
)

// processBatch decides what becomes of each of ds, hs[i] processing ds[i],
// as process decides one, and returns their Results in the same order. An
// id that an earlier delivery of the batch has is decided after the batch;
// a batch that loses a race on one of its ids, or whose transaction fails
// before its commit, commits nothing, and is processed again one at a time.
// A last delivery that met a failing store is held after the batch.
func (c *core) processBatch(ctx context.Context, ds []Delivery, hs []handler) []Result {
	xs := make([]*exchange, len(ds))
	exchanges := make([]engine.Exchange, len(ds))
	for i, d := range ds {
		xs[i] = &exchange{c: c, d: d, h: hs[i]}
		exchanges[i] = xs[i]
	}
	c.eng.ServeBatch(ctx, c.op, exchanges)
	results := make([]Result, len(ds))
	for i, x := range xs {
		results[i] = c.hold(ctx, ds[i], x.h, x.res)
	}
	return results
}
