package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"time"
)

// Horizon is how long after a message is first processed the broker may
// still deliver it again, as an adapter reads it from the broker's settings.
type Horizon struct {
	// Bound is the horizon, when Unbounded is false.
	Bound time.Duration
	// Unbounded is true when the broker may redeliver a message at any
	// time: it keeps messages without a limit of age and redelivers them
	// without a limit of count.
	Unbounded bool
	// Source names the settings it comes from, for the error: "stream
	// PAYMENTS: max age", "queue q: x-message-ttl".
	Source string
	// Fix says which of the broker's settings bounds it, for the error.
	Fix string
}

// HorizonError is CheckHorizon's answer when records would expire while the
// broker may still redeliver their messages: a message redelivered after its
// record expired runs again.
type HorizonError struct {
	Consumer  string
	Retention time.Duration
	Horizon   Horizon
}

func (e *HorizonError) Error() string {
	fix := e.Horizon.Fix
	if fix == "" {
		fix = "bound the broker's redelivery to at most the retention"
	}
	if e.Horizon.Unbounded {
		return fmt.Sprintf("idemkey/consumer: consumer %q keeps processed message ids for %s, but the broker may redeliver a message at any time (%s): "+
			"%s; or accept that a message redelivered later runs again (WithHorizonWarning)",
			e.Consumer, e.Retention, e.Horizon.Source, fix)
	}
	return fmt.Sprintf("idemkey/consumer: consumer %q keeps processed message ids for %s, but the broker may redeliver a message for %s (%s): "+
		"keep ids at least that long (engine.WithRetention), or %s; or accept that a message redelivered later runs again (WithHorizonWarning)",
		e.Consumer, e.Retention, e.Horizon.Bound, e.Horizon.Source, fix)
}

// CheckHorizon compares the consumer's retention with the broker's
// redelivery horizon h. When records would expire first it returns a
// *HorizonError, or, with WithHorizonWarning, logs it at Error level and
// returns nil.
func (c *Consumer) CheckHorizon(ctx context.Context, h Horizon) error {
	if !h.Unbounded && h.Bound <= c.eng.Retention() {
		return nil
	}
	err := &HorizonError{Consumer: c.op.Name(), Retention: c.eng.Retention(), Horizon: h}
	if c.opts.warnHorizon {
		c.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: a redelivered message may run again (WithHorizonWarning)",
			slog.String("operation", c.op.Name()), slog.Any("error", err))
		return nil
	}
	return err
}
