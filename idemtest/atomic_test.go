package idemtest_test

import (
	"context"
	"testing"

	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/internal/tbtest"
)

// CheckAtomic catches a handler that writes through the pool in atomic
// mode, naming postgres.TxFromContext, and passes one that writes through
// the call's transaction.
func TestCheckAtomic(t *testing.T) {
	b := openBackend(t, "postgres-atomic")
	for _, m := range []mistake{none, poolWrite} {
		r := tbtest.New(t)
		idemtest.New(r, idemtest.Chaos{Effects: b.effects}).CheckAtomic(b.store, func(ctx context.Context) error {
			_, err := b.charge(ctx, "cus_1", m, nil)
			return err
		})
		if m == none {
			tbtest.WantPass(t, r)
			continue
		}
		tbtest.WantFailure(t, r, "the handler wrote outside the call's transaction", "postgres.TxFromContext(ctx)", "not through the pool")
	}
	// A store without atomic mode is refused, with the reason.
	r := tbtest.New(t)
	func() {
		defer func() { recover() }()
		idemtest.New(r, idemtest.Chaos{Effects: b.effects}).CheckAtomic(openBackend(t, "memory").store, func(context.Context) error { return nil })
	}()
	tbtest.WantFailure(t, r, "store.Atomic")
}
