package idemtest

import (
	"context"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// CheckAtomic runs handle as one atomic call on st, whose transaction then
// rolls back, and fails the test if Chaos.Effects counts an effect that
// stayed: the handler wrote through the pool, so a retry makes it again.
// handle must succeed, so that it makes its effect:
//
//	kit.CheckAtomic(st, func(ctx context.Context) error {
//		_, err := svc.CreateCharge(ctx, req)
//		return err
//	})
//
// It needs Chaos.Effects, and a store.Atomic. A handler that writes nothing
// passes here; the Kit's checks of a call catch it.
func (k *Kit) CheckAtomic(st store.Store, handle func(ctx context.Context) error) {
	k.t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls++
	k.late(context.Background())
	defer func() { k.lastOK = false }()
	if k.chaos.Effects == nil {
		k.t.Fatalf("idemtest: CheckAtomic needs Chaos.Effects, to see whether the handler's effect outlived the call")
	}
	eng, err := engine.New(st, engine.WithSingleTenant())
	if err != nil {
		k.t.Fatalf("idemtest: CheckAtomic: %v", err)
	}
	op, err := eng.Operation(engine.OperationSpec{Name: "idemtest.CheckAtomic", Atomic: true})
	if err != nil {
		k.t.Fatalf("idemtest: CheckAtomic: %v", err)
	}
	ctx := context.Background()
	before, ok := k.effects(ctx)
	if !ok {
		return
	}
	x := &rolledBack{handle: handle}
	eng.Serve(ctx, op, x)
	after, ok := k.effects(ctx)
	switch {
	case !x.ran:
		k.t.Errorf("idemtest: CheckAtomic: the handler did not run: the store answered %s", x.answered)
	case x.err != nil:
		k.t.Errorf("idemtest: CheckAtomic: the handler failed in the call's transaction, so the check proves nothing: %v", x.err)
	case ok && after != before:
		k.t.Errorf("idemtest: the handler wrote outside the call's transaction: its transaction rolled back, yet %d effect(s) stayed. In atomic mode a handler must write through the transaction of postgres.TxFromContext(ctx), not through the pool (or another connection), so that its writes commit with the call's record or not at all", after-before)
	default:
		k.t.Logf("idemtest: CheckAtomic: the call's transaction rolled back, and with it the handler's effects")
	}
}

// rolledBack is the exchange of CheckAtomic's call: its handler runs, and
// its result is released, which rolls the call's transaction back.
type rolledBack struct {
	handle   func(ctx context.Context) error
	ran      bool
	err      error
	answered engine.Verdict
}

func (x *rolledBack) Key() (string, bool, error) { return idemkey.NewKey(), true, nil }

func (x *rolledBack) FirstSent() []string { return nil }

func (x *rolledBack) FirstRegion() []string { return nil }

func (x *rolledBack) Attempt() engine.Attempt { return engine.Attempt{} }

func (x *rolledBack) Fingerprint(context.Context) (store.Fingerprint, error) {
	return store.Fingerprint{}, nil
}

func (x *rolledBack) Run(ctx context.Context) engine.HandlerResult {
	x.ran = true
	x.err = x.handle(ctx)
	return engine.HandlerResult{Release: true}
}

func (x *rolledBack) StandIn(error) []byte { return nil }

func (x *rolledBack) Pass(context.Context) int { return 0 }

func (x *rolledBack) Answer(_ context.Context, a engine.Answer) int {
	x.answered = a.Verdict
	return 0
}
