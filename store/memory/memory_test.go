package memory_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		c := storetest.NewClock()
		return storetest.Harness{Store: memory.New(memory.WithClock(c.Now)), Advance: c.Advance}
	})
}

// Memory stays bounded by retention without anyone calling Sweep.
func TestReserveEvictsExpired(t *testing.T) {
	c := storetest.NewClock()
	st := memory.New(memory.WithClock(c.Now))
	ctx := context.Background()
	const perRound = 1000
	for round := range 5 {
		for i := range perRound {
			key := store.NewKey("t", "/m", string(rune(round*perRound+i)))
			res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Second, Retention: time.Minute})
			if err != nil || res.State != store.Acquired {
				t.Fatalf("Reserve = %v, %v", res.State, err)
			}
			if err := st.Complete(ctx, key, res.Token, []byte("ok")); err != nil {
				t.Fatal(err)
			}
		}
		c.Advance(t, time.Hour)
	}
	// Each round's reserves evicted the previous round's expired records.
	if n := st.Len(); n > perRound {
		t.Errorf("store holds %d records after 5 rounds of %d with retention passing between them; want at most %d", n, perRound, perRound)
	}
}

func TestCanceledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st := memory.New()
	if _, err := st.Reserve(ctx, store.Reservation{Key: store.NewKey("t", "/m", "k")}); err != context.Canceled {
		t.Errorf("Reserve on a canceled context: err = %v, want context.Canceled", err)
	}
}
