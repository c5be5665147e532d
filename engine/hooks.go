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

// Hooks are the application's own callbacks on how each call ended (see
// WithHooks): one of them, at most, runs once for every covered call, given
// the call's Event. A nil field is skipped.
//
// idemkey logs none of an Event's values: a hook sees the raw key and
// tenant, and what it does with them is the application's concern.
type Hooks struct {
	// OnExecute: the handler ran. Event.Verdict is Executed (it ran under the
	// key; Event.Recorded tells whether its outcome is now the key's
	// record, which every retry gets, or the key was released and a retry
	// runs it again), NoKey (the call had no key, and none is required) or
	// FailedOpen (the store failed, and WithFailOpen ran it unprotected).
	OnExecute func(ctx context.Context, ev Event)
	// OnReplay: the call got the key's recorded outcome without running the
	// handler (Verdict Replayed); or, in atomic mode, its handler ran but
	// another call recorded the key first (a rare race), so
	// its writes were rolled back and it answers with that call's record.
	// Such a call that is answered otherwise (in progress, reused, store
	// unavailable) runs OnRefuse: a call reports the verdict it is answered
	// with, and no execution whose effects were undone.
	OnReplay func(ctx context.Context, ev Event)
	// OnRefuse: the call was answered without running the handler and
	// without a replay, for the reason Event.Verdict names: InProgress,
	// Reused, KeyMissing, KeyInvalid, StoreUnavailable, StoreFull, Expired,
	// FirstSentInvalid, or Refused (the tenant or the request was refused,
	// or the operation cannot be replayed, before the key was looked up).
	OnRefuse func(ctx context.Context, ev Event)
}

// Event is what a hook is told about one call.
type Event struct {
	// Operation is the operation's name: the gRPC method or Connect
	// procedure ("/package.Service/Method"), the HTTP operation (the route's
	// pattern by default), the consumer's name.
	Operation string
	// Tenant and Key are the call's tenant (WithTenant; "" without it) and
	// its idempotency key (a message's id), as the caller sent them. Both
	// are "" when the call ended before they were read: NoKey, KeyMissing,
	// KeyInvalid (a malformed key is never handed on), Refused.
	Tenant, Key string
	// Verdict is what became of the call, as the idemkey.outcome attribute
	// of its metrics says.
	Verdict Verdict
	// Code is the call's final status, as the entry point answered it: a
	// gRPC or Connect code, an HTTP status, a consumer.Action.
	Code int
	// Size is the record's size in bytes: for Executed with Recorded, the
	// outcome recorded; for Replayed, the record replayed; else 0. It is the
	// entry point's encoding of the outcome, before it is sealed
	// (WithSealer) and after it is opened, so a replay's is its execution's.
	Size int
	// Recorded is true for an Executed call whose outcome was recorded: the
	// handler's, or the short error recorded in place of one too large to
	// record. In two-phase mode that includes a write that failed and is
	// retried in the background: the caller got the outcome.
	// It is false when the key was released (a released code), or the
	// record was refused (a lost lease, a full store, a failed commit in
	// atomic mode).
	Recorded bool
}

// WithHooks sets the application's callbacks on how each call ended: on
// an execution of the handler, on a replay, and on a refusal. Exactly one
// Hooks field applies to each call that reaches the entry point's request
// path (a covered method, route or message), and runs once, when the call's
// verdict is final: after its outcome is recorded or its key released, and
// before the entry point hands its answer over: before a gRPC or Connect
// interceptor returns, before an HTTP answer of the middleware's own (a
// replay, a recorded response, a problem) is written, before a consumer's
// Process returns, so before the message is acknowledged. A handler's own
// response to a call without a key, or one that failed open, is written by
// the handler first.
//
// They run synchronously, on the call's goroutine: their time adds to the
// call's, so that a caller who has its answer knows the hook has returned.
// A hook holds no key and no store connection (the record is written, or
// the transaction committed, before it runs), but a slow one delays its
// caller's answer by as long as it takes, and idemkey puts no bound on it:
// send what takes long to a queue of the application's own. ctx carries
// the call's values (its span, the authenticated identity) but not its
// cancellation or deadline, since the call has happened whether or not
// its caller is still there: bound network work with a context.WithTimeout
// of the hook's own.
//
// A hook that panics is recovered: the call's answer and its record stand,
// and the panic is logged at Error with the call's operation and scope
// (never the raw key or tenant), the panic's words only if the Go runtime
// raised it (a nil dereference, an index out of range), and the stack. A
// handler that panics ends no call: its key is released, the panic goes
// on, and no hook runs.
//
// A later WithHooks replaces an earlier one whole.
func WithHooks(h Hooks) Option {
	return func(o *options) {
		o.hooks = nil
		if h.OnExecute != nil || h.OnReplay != nil || h.OnRefuse != nil {
			o.hooks = &h
		}
	}
}

// noteWrite notes, for the hooks, how a write of a record of size bytes
// ended (err is the store's answer): recorded, or about to be retried in the
// background by call.record, in two-phase mode, for any error but a refusal.
func (c *call) noteWrite(size int, err error) {
	if err != nil && (c.tx != nil || errors.Is(err, store.ErrFull) || errors.Is(err, store.ErrLeaseLost) || errors.Is(err, store.ErrDataLost)) {
		return
	}
	c.recordedSize, c.recorded = size, true
}

// runHooks runs the hook of c's verdict, if one is set.
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
		hook = h.OnRefuse
	}
	if hook != nil {
		c.callHook(context.WithoutCancel(ctx), name, hook, ev)
	}
}

// callHook calls hook, and logs a panic of its instead of letting it go on.
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

// hookPanic describes a hook's panic value p: the words of the Go runtime's
// own errors, which quote nothing of a call's, and only the type of any
// other value, which might hold the key or the tenant the hook was given.
func hookPanic(p any) error {
	if err, ok := p.(runtime.Error); ok {
		return err
	}
	return fmt.Errorf("a panic with a value of type %T (its words are not logged: they may quote the call's key or tenant)", p)
}

// hookStack is the stack of a panicking hook, called from its deferred
// recover: each frame's function, file and line. Unlike debug.Stack, it
// prints no argument words, which may hold a few bytes of the key.
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
