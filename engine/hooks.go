package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"

	"github.com/idemkey/idemkey/store"
)

// Hooks are the application's callbacks on how each call ended (WithHooks).
// A nil field is skipped. A hook sees the raw key and tenant; idemkey logs
// none of an Event's values.
type Hooks struct {
	// OnExecute: the handler ran (Executed, with Event.Recorded; NoKey;
	// FailedOpen).
	OnExecute func(ctx context.Context, ev Event)
	// OnReplay: the call got the key's record without running the handler;
	// or, in atomic mode, its handler ran but another call recorded the key
	// first, so its writes were rolled back and it answers with that record.
	OnReplay func(ctx context.Context, ev Event)
	// OnRefuse: answered without running the handler or a replay, for the
	// reason Event.Verdict names; or, for OutcomeUnknown, StoreUnavailable
	// and Reused, after a step of its handler (Step) ended it so.
	OnRefuse func(ctx context.Context, ev Event)
}

// Event is what a hook is told about one call.
type Event struct {
	// Operation is the operation's name ("/package.Service/Method", the
	// HTTP route's pattern, the consumer's name).
	Operation string
	// Tenant and Key are as the caller sent them; "" when the call ended
	// before they were read (NoKey, KeyMissing, KeyInvalid, Refused).
	Tenant, Key string
	Verdict     Verdict
	// Code is the final status answered: a gRPC or Connect code, an HTTP
	// status, a consumer.Action.
	Code int
	// Size is the bytes recorded (Executed and Recorded) or replayed, else
	// 0: the entry point's encoding, before sealing.
	Size int
	// Recorded is true for an Executed call whose outcome, or stand-in, was
	// recorded, including a two-phase write retried in the background; false
	// when the key was released or the record refused.
	Recorded bool
	// Step names the step (Step) that ended the call so: for
	// OutcomeUnknown, the one for an operator to resolve; "" for a call no
	// step ended.
	Step string
}

// WithHooks sets the application's callbacks. One runs once for each call
// that reaches the request path, when its verdict is final and before the
// entry point hands its answer over, on the call's goroutine: a slow one
// delays its caller, and its ctx has the call's values but not its
// cancellation. A panic in a hook is recovered and logged without its words.
// A later WithHooks replaces an earlier one whole. See docs/operations.md.
func WithHooks(h Hooks) Option {
	return func(o *options) {
		o.hooks = nil
		if h.OnExecute != nil || h.OnReplay != nil || h.OnRefuse != nil {
			o.hooks = &h
		}
	}
}

// noteWrite notes, for the hooks, how a write of size bytes ended: recorded,
// or to be retried in the background (two-phase mode, any error but a
// refusal).
func (c *call) noteWrite(size int, err error) {
	if err != nil && (c.tx != nil || errors.Is(err, store.ErrFull) || errors.Is(err, store.ErrLeaseLost) || errors.Is(err, store.ErrDataLost)) {
		return
	}
	c.recordedSize, c.recorded = size, true
}

func (c *call) runHooks(ctx context.Context, code int) {
	h := c.e.opts.hooks
	if h == nil {
		return
	}
	ev := Event{Operation: c.op.name, Tenant: c.tenant, Key: c.userKey, Verdict: c.Verdict, Code: code}
	var hook func(context.Context, Event)
	name := "OnRefuse"
	switch c.Verdict {
	case Executed:
		hook, name = h.OnExecute, "OnExecute"
		if c.recorded {
			ev.Size, ev.Recorded = c.recordedSize, true
		}
	case NoKey, FailedOpen:
		hook, name = h.OnExecute, "OnExecute"
	case Replayed:
		hook, name = h.OnReplay, "OnReplay"
		ev.Size = len(c.Outcome)
	default:
		hook, ev.Step = h.OnRefuse, c.step
	}
	if hook != nil {
		c.callHook(context.WithoutCancel(ctx), name, hook, ev)
	}
}

func (c *call) callHook(ctx context.Context, name string, hook func(context.Context, Event), ev Event) {
	defer func() {
		p := recover()
		if p == nil {
			return
		}
		attrs := []slog.Attr{slog.String("operation", c.op.name)}
		if c.started {
			attrs = append(attrs, slog.String("scope", c.key.String()))
		}
		attrs = append(attrs, slog.String("outcome", ev.Verdict.String()),
			slog.Any("error", hookPanic(p)), slog.String("stack", hookStack()))
		c.e.opts.logger.LogAttrs(ctx, slog.LevelError, "idemkey: the "+name+" hook panicked; the call's answer and record stand", attrs...)
	}()
	hook(ctx, ev)
}

// hookPanic describes a hook's panic value: the Go runtime's own errors,
// which quote nothing of a call's, else only the type, since the value might
// hold the key or tenant the hook was given.
func hookPanic(p any) error {
	if err, ok := p.(runtime.Error); ok {
		return err
	}
	return fmt.Errorf("a panic with a value of type %T (its words are not logged: they may quote the call's key or tenant)", p)
}

// hookStack is the panicking hook's stack, without debug.Stack's argument
// words, which may hold a few bytes of the key.
func hookStack() string {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(3, pcs)]) // from the panic
	var b strings.Builder
	for {
		f, more := frames.Next()
		fmt.Fprintf(&b, "%s\n\t%s:%d\n", f.Function, f.File, f.Line)
		if !more {
			return b.String()
		}
	}
}
