package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The janitor sweeps at start and on every tick, and stops with its context.
func TestJanitor(t *testing.T) {
	clock := storetest.NewClock()
	st := memory.New(memory.WithClock(clock.Now))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	expire := func(keys ...string) {
		for _, k := range keys {
			key := store.NewKey("t", "/m", k)
			res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Second, Retention: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Complete(ctx, key, res.Token, []byte(k)); err != nil {
				t.Fatal(err)
			}
		}
		clock.Advance(t, time.Hour)
	}
	waitEmpty := func() {
		for deadline := time.Now().Add(10 * time.Second); st.Len() > 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the janitor left %d expired records", st.Len())
			}
		}
	}

	expire("a", "b", "c")
	done := make(chan error, 1)
	go func() { done <- (&store.Janitor{Store: st, Interval: 5 * time.Millisecond, BatchSize: 1}).Run(ctx) }()
	waitEmpty()
	expire("d") // swept on a later tick
	waitEmpty()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
}
