package store

import (
	"context"
	"log/slog"
	"time"
)

// DefaultSweepInterval is how often a Janitor sweeps unless told otherwise.
const DefaultSweepInterval = time.Minute

// Janitor deletes expired records by calling Store.Sweep periodically. It
// starts nothing on its own: run it in a goroutine you own and stop it by
// cancelling the context.
//
//	j := &store.Janitor{Store: st, Logger: logger}
//	go j.Run(ctx)
type Janitor struct {
	Store Store
	// Interval between sweeps; DefaultSweepInterval if zero.
	Interval time.Duration
	// BatchSize is passed to Sweep; DefaultSweepBatch if zero.
	BatchSize int
	// Logger receives a line per sweep that deleted records (Debug) or failed
	// (Warn); nil discards.
	Logger *slog.Logger
}

// Run sweeps at once and then every Interval until ctx is done, and then
// returns ctx's error. A failed sweep is logged and tried again at the next
// tick: a store that is down for a while must not stop the janitor.
func (j *Janitor) Run(ctx context.Context) error {
	interval := j.Interval
	if interval <= 0 {
		interval = DefaultSweepInterval
	}
	logger := j.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		start := time.Now()
		deleted, err := j.Store.Sweep(ctx, j.BatchSize)
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
