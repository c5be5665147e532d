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

// DurationBuckets are the idemkey.store.duration histogram's, in seconds.
var DurationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}

const defaultSweepInterval = time.Minute

// Janitor calls a Sweeper's Sweep periodically, in a goroutine you own:
// go j.Run(ctx).
type Janitor struct {
	Store         Store
	Interval      time.Duration        // between sweeps; a minute if zero
	BatchSize     int                  // for Sweep; DefaultSweepBatch if zero
	Logger        *slog.Logger         // Debug per sweep that deleted, Warn per failure; nil discards
	MeterProvider metric.MeterProvider // idemkey.store.duration, idemkey.sweep.deleted; nil: the global one
}

// Run sweeps every Interval until ctx is done; a failed sweep is logged and
// tried again. For a store that is no Sweeper it returns nil at once.
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
