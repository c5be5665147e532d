package store

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// DurationBuckets are the bucket boundaries, in seconds, of the
// idemkey.store.duration histogram, which the engine and Janitor both
// record: from half a millisecond, a fast store's statement, to 5s, the
// postgres store's default timeout.
var DurationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}

// defaultSweepInterval is how often a Janitor sweeps unless told otherwise.
const defaultSweepInterval = time.Minute

// Janitor deletes expired records by calling the store's Sweep periodically,
// for a store that implements Sweeper. It starts nothing on its own: run it in
// a goroutine you own and stop it by cancelling the context.
//
//	j := &store.Janitor{Store: st, Logger: logger}
//	go j.Run(ctx)
type Janitor struct {
	Store Store
	// Interval between sweeps; a minute if zero.
	Interval time.Duration
	// BatchSize is passed to Sweep; DefaultSweepBatch if zero.
	BatchSize int
	// Logger receives a line per sweep that deleted records (Debug) or failed
	// (Warn); nil discards.
	Logger *slog.Logger
	// MeterProvider receives the sweeps' metrics: idemkey.store.duration with
	// idemkey.store.operation "sweep", and idemkey.sweep.deleted, the records
	// deleted. Nil means otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// Run sweeps at once and then every Interval until ctx is done, and then
// returns ctx's error. A failed sweep is logged and tried again at the next
// tick: a store that is down for a while must not stop the janitor.
//
// A store that does not implement Sweeper expires its records by itself: Run
// logs so at Info and returns nil at once, having nothing to do.
func (j *Janitor) Run(ctx context.Context) error {
	interval := j.Interval
	if interval <= 0 {
		interval = defaultSweepInterval
	}
	logger := j.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	sweeper, ok := j.Store.(Sweeper)
	if !ok {
		logger.LogAttrs(ctx, slog.LevelInfo, "idemkey: the store expires records by itself; the janitor has nothing to sweep and stops",
			slog.String("store", fmt.Sprintf("%T", j.Store)))
		return nil
	}
	meters := j.MeterProvider
	if meters == nil {
		meters = otel.GetMeterProvider()
	}
	meter := meters.Meter("github.com/idemkey/idemkey/store")
	// The API's instruments work even when their creation reports an error.
	took, _ := meter.Float64Histogram("idemkey.store.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of the idempotency store's operations."),
		metric.WithExplicitBucketBoundaries(DurationBuckets...))
	swept, _ := meter.Int64Counter("idemkey.sweep.deleted", metric.WithUnit("{record}"),
		metric.WithDescription("Expired idempotency records the janitor deleted."))
	sweepOK := metric.WithAttributes(attribute.String("idemkey.store.operation", "sweep"))
	sweepFailed := metric.WithAttributes(attribute.String("idemkey.store.operation", "sweep"), attribute.String("error.type", "store_failed"))

	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		start := time.Now()
		deleted, err := sweeper.Sweep(ctx, j.BatchSize)
		swept.Add(ctx, int64(deleted))
		if err != nil {
			took.Record(ctx, time.Since(start).Seconds(), sweepFailed)
		} else {
			took.Record(ctx, time.Since(start).Seconds(), sweepOK)
		}
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			logger.LogAttrs(ctx, slog.LevelWarn, "idemkey: sweep failed", slog.Int("deleted", deleted), slog.Any("error", err))
		case deleted > 0:
			logger.LogAttrs(ctx, slog.LevelDebug, "idemkey: swept expired records", slog.Int("deleted", deleted), slog.Duration("took", time.Since(start)))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ticker.C:
		}
	}
}
