package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

// The janitor sweeps at start and on every tick, and stops with its context.
func TestJanitor(t *testing.T) {
	clock := storetest.NewClock()
	st := memory.New(memory.WithClock(clock.Now))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	expire := func(keys ...string) {
		for _, k := range keys {
			key := store.ScopeKey("t", "/m", k)
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
	reader := sdkmetric.NewManualReader()
	done := make(chan error, 1)
	go func() {
		j := &store.Janitor{Store: st, Interval: 5 * time.Millisecond, BatchSize: 1, MeterProvider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
		done <- j.Run(ctx)
	}()
	waitEmpty()
	expire("d") // swept on a later tick
	waitEmpty()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	deleted := int64(-1)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "idemkey.sweep.deleted" {
				deleted = m.Data.(metricdata.Sum[int64]).DataPoints[0].Value
			}
		}
	}
	if deleted != 4 {
		t.Errorf("idemkey.sweep.deleted = %d, want the 4 records swept", deleted)
	}
}

// A store that expires records by itself gives the janitor nothing to do: it
// says so and returns at once rather than tick for nothing.
func TestJanitorWithoutSweeper(t *testing.T) {
	logger, logs := logtest.New()
	var st struct{ store.Store } // hides memory's Sweep
	st.Store = memory.New()
	done := make(chan error, 1)
	go func() { done <- (&store.Janitor{Store: st, Logger: logger}).Run(context.Background()) }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run of a store without Sweep did not return")
	}
	if !strings.Contains(logs.String(), "nothing to sweep") {
		t.Errorf("the janitor did not log that it has nothing to sweep; logged:\n%s", logs)
	}
}
