package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"unicode/utf8"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// ErrOutcomeUnknown is Step's error for a step that an earlier run of the
// key started and never finished, when no reconcile function could tell
// whether it took effect. The call is answered OutcomeUnknown, whatever its
// handler returns, until a reconcile tells or an operator resolves the step
// (idemkey resolve-step).
var ErrOutcomeUnknown = errors.New("idemkey: a step's outcome is unknown: an earlier run started it and never finished")

// Step runs do as the step name of the call whose handler ctx is, at most
// once per key: an effect outside the handler's transaction, such as a
// charge at a card processor. Its result is recorded under the key as soon
// as do returns, outside any transaction, and a later run of the key (a
// retry after a released failure, a takeover after a crash, a redelivered
// message) gets it back without running do. Each name is one step of the
// operation: give each a constant, unique in a run.
//
// Step records that the step started before it runs do. A run that finds
// it started and not finished never runs it blind: it asks reconcile, which
// tells done (with the result: it is recorded), not done (do runs), or
// returns an error when it cannot tell. Without a reconcile function, or
// when it cannot tell, Step returns ErrOutcomeUnknown and the call answers
// OutcomeUnknown. do and reconcile get a context whose client key
// (idemkey.KeyFromContext, which idemkey's client interceptors send) is the
// step's own, idemkey.DeriveKey of the call's parts and name: the key to
// give the downstream call, and to look it up by.
//
// An error from do leaves the step started, its outcome unknown, unless it
// is NotDone's. The result is recorded as encoding/json encodes it, sealed
// with the engine's Sealer, at most WithMaxRecordSize bytes; Step returns
// it decoded, as a later run gets it, so T must survive encoding/json. A
// result that cannot be recorded, or a store that fails, leaves the step
// started, and the call is answered StoreUnavailable with its key released.
// A key reused with another request is answered Reused.
//
// Outside a call that holds a key (a call without one, one failed open, a
// test calling the handler itself) Step runs do, and records nothing.
func Step[T any](ctx context.Context, name string, do func(context.Context) (T, error),
	reconcile func(context.Context) (result T, done bool, err error)) (T, error) {
	var out T
	r, ok := ctx.Value(runningKey{}).(*running)
	if !ok {
		return do(ctx)
	}
	f := stepFuncs{do: func(ctx context.Context) (any, error) { return do(ctx) }}
	if reconcile != nil {
		f.reconcile = func(ctx context.Context) (any, bool, error) { return reconcile(ctx) }
	}
	result, err := r.step(ctx, name, f)
	if err != nil {
		return out, err
	}
	if err := json.Unmarshal(result, &out); err != nil {
		return out, r.fail(ctx, name, "its recorded result does not decode", err)
	}
	return out, nil
}

// NotDone marks do's error as one that took no effect: the step's record
// is deleted, and the key's next run runs it again. A declined card is
// NotDone; a timeout is not, since the processor may have charged.
func NotDone(err error) error { return notDone{err} }

type notDone struct{ error }

func (e notDone) Unwrap() error { return e.error }

// ForgetSteps asks that, if the call whose handler ctx is ends by
// releasing its key (a retryable failure), its steps' records be deleted
// too, so that the retry runs every step again. By default a released
// call's steps are kept, and the retry gets their results.
func ForgetSteps(ctx context.Context) {
	if r, ok := ctx.Value(runningKey{}).(*running); ok {
		r.mu.Lock()
		r.forget = true
		r.mu.Unlock()
	}
}

// running is a handler's context when its call holds its key: Step
// records under the key through it, and it renews a two-phase lease while
// the handler runs.
type running struct {
	context.Context
	e               *Engine
	op              *Operation
	key             store.Key
	partition       store.Partition
	token           store.Token // 0 in atomic mode, where the transaction holds the key
	fp              store.Fingerprint
	tenant, userKey string

	mu      sync.Mutex
	names   map[string]bool // the steps started in this run
	verdict Verdict         // Executed, or what a step made of the call (stepVerdict)
	ender   string          // the step that set verdict, for the hooks
	forget  bool            // ForgetSteps
	sent    int             // the messages MessageID numbered

	renewal *renewal // while the handler runs, in two-phase mode
}

type runningKey struct{}

func (r *running) Value(key any) any {
	if key == (runningKey{}) {
		return r
	}
	return r.Context.Value(key)
}

// stepFuncs are a Step's functions with their results as any.
type stepFuncs struct {
	do        func(context.Context) (any, error)
	reconcile func(context.Context) (any, bool, error) // nil if none
}

// step runs step name as Step says, and returns its recorded result.
func (r *running) step(ctx context.Context, name string, f stepFuncs) ([]byte, error) {
	e := r.e
	if e.stepper == nil {
		return nil, fmt.Errorf("idemkey: engine.Step needs a store that implements store.Stepper; %T does not", e.store)
	}
	if err := r.claim(name); err != nil {
		return nil, err
	}
	got, err := e.startStep(ctx, r.partition, store.StepStart{Key: r.key, Name: name, Token: r.token, Fingerprint: r.fp, Retention: r.op.retention})
	if err != nil {
		return nil, r.fail(ctx, name, "recording its start failed", err)
	}
	if got.State != store.StepNew && got.Fingerprint != r.fp {
		r.end(Reused, name)
		return nil, errStepReused
	}
	sctx := idemkey.ContextWithKey(ctx, idemkey.DeriveKey(r.tenant, r.op.name, r.userKey, name))
	switch got.State {
	case store.StepDone:
		result, err := e.openStep(r.key, name, got.Result)
		if err != nil {
			return nil, r.fail(ctx, name, "its recorded result does not open", err)
		}
		return result, nil
	case store.StepStarted:
		if f.reconcile == nil {
			return nil, r.unknown(ctx, name, nil)
		}
		v, done, err := f.reconcile(sctx)
		switch {
		case err != nil:
			return nil, r.unknown(ctx, name, err)
		case done:
			return r.finish(ctx, name, v)
		}
	}
	v, err := f.do(sctx)
	if errors.As(err, new(notDone)) {
		if ferr := e.forgetSteps(context.WithoutCancel(ctx), r.partition, r.key, r.token, name); ferr != nil {
			return nil, r.fail(ctx, name, "forgetting it (NotDone) failed", ferr)
		}
		return nil, err
	}
	if err != nil {
		return nil, err
	}
	return r.finish(ctx, name, v)
}

// claim refuses a name that is not 1 to 200 bytes of UTF-8 (a store may
// keep it as text), or is used twice in a run.
func (r *running) claim(name string) error {
	if name == "" || len(name) > 200 || !utf8.ValidString(name) {
		return errors.New("idemkey: a step's name must be 1 to 200 bytes of UTF-8")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.names[name] {
		return fmt.Errorf("idemkey: step %q is used twice in one run: give each step its own name", name)
	}
	if r.names == nil {
		r.names = make(map[string]bool)
	}
	r.names[name] = true
	return nil
}

// finish records v as step name's result, and returns its encoding. The
// effect has happened: the write ignores the caller's cancellation.
func (r *running) finish(ctx context.Context, name string, v any) ([]byte, error) {
	e := r.e
	result, err := json.Marshal(v)
	if err != nil {
		return nil, r.fail(ctx, name, "its result cannot be encoded with encoding/json", err)
	}
	if len(result) > e.opts.maxRecord {
		return nil, r.fail(ctx, name, "its result cannot be recorded", tooLarge(len(result), e.opts.maxRecord))
	}
	sealed, err := e.sealStep(r.key, name, result)
	if err == nil {
		err = e.finishStep(context.WithoutCancel(ctx), r.partition, r.key, r.token, name, sealed)
	}
	if err != nil {
		return nil, r.fail(ctx, name, "recording its result failed", err)
	}
	return result, nil
}

// fail ends the call StoreUnavailable (StoreFull, for a store at a bound)
// for err, which the store or the step's result caused: its key is
// released, and the step stays as it is.
func (r *running) fail(ctx context.Context, name, what string, err error) error {
	v := StoreUnavailable
	if errors.Is(err, store.ErrFull) {
		v = StoreFull
	}
	r.end(v, name)
	r.log(ctx, slog.LevelError, name, what+"; the call answers "+v.String()+" and its key is released, and a started step stays started for the next run to reconcile", err)
	return fmt.Errorf("idemkey: step %q: %s: %w", name, what, err)
}

// unknown ends the call OutcomeUnknown for step name.
func (r *running) unknown(ctx context.Context, name string, reconcileErr error) error {
	r.end(OutcomeUnknown, name)
	what := "it has no reconcile function"
	if reconcileErr != nil {
		what = "its reconcile function could not tell"
	}
	r.log(ctx, slog.LevelError, name, "an earlier run started the step and never finished it, and "+what+
		"; the call answers outcome unknown until a reconcile tells or an operator resolves it (idemkey resolve-step)", nil)
	if reconcileErr != nil {
		return fmt.Errorf("%w: step %q: %w", ErrOutcomeUnknown, name, reconcileErr)
	}
	return fmt.Errorf("%w: step %q", ErrOutcomeUnknown, name)
}

// end sets the verdict a step made of the call: the first one stands, but
// Reused outranks the others.
func (r *running) end(v Verdict, name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.verdict == Executed || v == Reused {
		r.verdict, r.ender = v, name
	}
}

// stepVerdict is what a step made of the call: Executed if nothing, and
// whether to forget its steps.
func (r *running) stepVerdict() (v Verdict, step string, forget bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.verdict, r.ender, r.forget
}

func (r *running) log(ctx context.Context, level slog.Level, step, msg string, err error) {
	attrs := []slog.Attr{slog.String("operation", r.op.name), slog.String("scope", r.key.String())}
	if step != "" {
		attrs = append(attrs, slog.String("step", step))
	}
	if err != nil {
		attrs = append(attrs, slog.Any("error", err))
	}
	r.e.opts.logger.LogAttrs(context.WithoutCancel(ctx), level, "idemkey: step: "+msg, attrs...)
}

// errStepReused is Step's error when the key's steps were recorded for
// another request.
var errStepReused = errors.New("idemkey: the idempotency key's steps were recorded for another request")

func (e *Engine) sealStep(key store.Key, name string, result []byte) ([]byte, error) {
	return e.sealOutcome(store.StepKey(key, name), result)
}

// openStep opens a recorded result; as opened, a sealed one without a
// sealer is errUnopened.
func (e *Engine) openStep(key store.Key, name string, result []byte) ([]byte, error) {
	res, err := e.opened(store.StepKey(key, name), nil, store.Entry{State: store.Completed, Outcome: result})
	return res.Outcome, err
}
