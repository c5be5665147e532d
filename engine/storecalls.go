package engine

import (
	"context"
	"time"

	"github.com/idemkey/idemkey/store"
)

// The engine's store calls, each measured (the store's time alone). With a
// sealer, outcomes written are sealed and those read opened. Each call's
// context carries its call's partition (store.ContextWithPartition), for a
// store that routes by tenant (store/pgshard); a batch's carries none, its
// reservations each their own.
func (e *Engine) reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	r = e.roomFor(r)
	sctx, t := e.obs.startStore(ctx, opReserve)
	res, err := e.store.Reserve(store.ContextWithPartition(sctx, r.Partition), r)
	t.end(ctx, err)
	if err != nil {
		return res, err
	}
	return e.opened(r.Key, &r.Fingerprint, res)
}

func (e *Engine) find(ctx context.Context, p store.Partition, key store.Key) (store.Entry, bool, error) {
	sctx, t := e.obs.startStore(ctx, opFind)
	res, found, err := e.finder.Find(store.ContextWithPartition(sctx, p), key)
	t.end(ctx, err)
	if err != nil || !found {
		return res, found, err
	}
	res, err = e.opened(key, nil, res)
	return res, err == nil, err
}

// lookup opens a completed record as find does; a record that does not
// open is errUnopened.
func (e *Engine) lookup(ctx context.Context, p store.Partition, key store.Key) (store.Entry, []string, bool, error) {
	sctx, t := e.obs.startStore(ctx, opLookup)
	res, steps, found, err := e.looker.Lookup(store.ContextWithPartition(sctx, p), key)
	t.end(ctx, err)
	if err != nil || !found {
		return res, steps, found, err
	}
	res, err = e.opened(key, nil, res)
	return res, steps, err == nil, err
}

func (e *Engine) begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	r = e.roomFor(r)
	sctx, t := e.obs.startStore(ctx, opBegin)
	res, tx, err := e.atomic.Begin(store.ContextWithPartition(sctx, r.Partition), r)
	t.end(ctx, err)
	if err != nil {
		return res, tx, err
	}
	if tx != nil && e.sealer() != nil {
		tx = sealingTx{Tx: tx, e: e, key: r.Key}
	}
	res, err = e.opened(r.Key, &r.Fingerprint, res)
	return res, tx, err
}

func (e *Engine) commit(ctx context.Context, c *call, outcome []byte, keepWrites bool) error {
	sctx, t := e.obs.startStore(ctx, opCommit)
	err := c.tx.Commit(store.ContextWithPartition(sctx, c.partition), outcome, keepWrites)
	t.end(ctx, err)
	c.noteWrite(len(outcome), err)
	return err
}

// complete and storeRelease ignore the caller's cancellation (see
// call.record), after the span lookup, which would allocate on a detached
// context.
func (e *Engine) complete(ctx context.Context, c *call, outcome []byte) error {
	size := len(outcome) // for the hooks: the entry point's encoding, as replays get it
	outcome, err := e.sealOutcome(c.key, outcome)
	if err == nil {
		sctx, t := e.obs.startStore(ctx, opComplete)
		err = e.store.Complete(store.ContextWithPartition(context.WithoutCancel(sctx), c.partition), c.key, c.token, outcome)
		t.end(ctx, err)
	}
	c.noteWrite(size, err)
	return err
}

func (e *Engine) storeRelease(ctx context.Context, c *call) error {
	sctx, t := e.obs.startStore(ctx, opRelease)
	err := e.store.Release(store.ContextWithPartition(context.WithoutCancel(sctx), c.partition), c.key, c.token)
	t.end(ctx, err)
	return err
}

func (e *Engine) beginBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, store.BatchTx, error) {
	sctx, t := e.obs.startStore(ctx, opBeginBatch)
	res, tx, err := e.batchStore.BeginBatch(sctx, rs)
	t.end(ctx, err)
	return res, tx, err
}

func (e *Engine) reserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	sctx, t := e.obs.startStore(ctx, opReserveBatch)
	res, err := e.batchReserver.ReserveBatch(sctx, rs)
	t.end(ctx, err)
	return res, err
}

func (e *Engine) commitBatch(ctx context.Context, tx store.BatchTx) error {
	sctx, t := e.obs.startStore(ctx, opCommitBatch)
	err := tx.Commit(context.WithoutCancel(sctx))
	t.end(ctx, err)
	return err
}

func (e *Engine) startStep(ctx context.Context, p store.Partition, s store.StepStart) (store.StepEntry, error) {
	sctx, t := e.obs.startStore(ctx, opStartStep)
	res, err := e.stepper.StartStep(store.ContextWithPartition(sctx, p), s)
	t.end(ctx, err)
	return res, err
}

func (e *Engine) finishStep(ctx context.Context, p store.Partition, key store.Key, token store.Token, name string, result []byte) error {
	sctx, t := e.obs.startStore(ctx, opFinishStep)
	err := e.stepper.FinishStep(store.ContextWithPartition(sctx, p), key, token, name, result)
	t.end(ctx, err)
	return err
}

func (e *Engine) forgetSteps(ctx context.Context, p store.Partition, key store.Key, token store.Token, names ...string) error {
	sctx, t := e.obs.startStore(ctx, opForgetSteps)
	err := e.stepper.ForgetSteps(store.ContextWithPartition(sctx, p), key, token, names...)
	t.end(ctx, err)
	return err
}

func (e *Engine) renew(ctx context.Context, p store.Partition, key store.Key, token store.Token, lease time.Duration) error {
	sctx, t := e.obs.startStore(ctx, opRenew)
	err := e.renewer.Renew(store.ContextWithPartition(sctx, p), key, token, lease)
	t.end(ctx, err)
	return err
}
