package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"time"
)

// Horizon is how long after a message is first processed the broker may
// still deliver it again, as a Broker reads it from the broker's settings.
type Horizon struct {
	// Bound is the horizon, when Unbounded is false.
	Bound time.Duration
	// Unbounded is true when the broker may deliver a message again at any
	// time.
	Unbounded bool
	// Source names the settings it comes from: "stream PAYMENTS: max age".
	Source string
	// Fix says which of the broker's settings bounds it.
	Fix string
}

// HorizonError is New's refusal of a consumer whose records would expire
// while the broker may still deliver their messages again: such a message
// would run again.
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
		"keep ids at least that long (engine.WithRetention, or consumer.WithRetention), or %s; or accept that a message redelivered later runs again (WithHorizonWarning)",
		e.Consumer, e.Retention, e.Horizon.Bound, e.Horizon.Source, fix)
}

// checkHorizon returns a *HorizonError when records would expire before h
// ends; with WithHorizonWarning it logs it at Error level instead.
func (c *core) checkHorizon(h Horizon) error {
	if !h.Unbounded && h.Bound <= c.op.Retention() {
		return nil
	}
	err := &HorizonError{Consumer: c.op.Name(), Retention: c.op.Retention(), Horizon: h}
	if !c.opts.warnHorizon {
		return err
	}
	c.eng.Logger().LogAttrs(context.Background(), slog.LevelError, "idemkey: a redelivered message may run again (WithHorizonWarning)",
		slog.String("operation", c.op.Name()), slog.Any("error", err))
	return nil
}
