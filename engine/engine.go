package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Engine runs calls at most once per idempotency key on one store. It is safe
// for concurrent use; entry points that share a store share one engine.
type Engine struct {
	store         store.Store
	atomic        store.Atomic  // store, if it implements store.Atomic
	finder        store.Finder  // store, if it implements store.Finder
	watcher       store.Watcher // store, if it implements store.Watcher
	stepper       store.Stepper // store, if it implements store.Stepper (step.go)
	renewer       store.Renewer // store, if it implements store.Renewer (renew.go)
	looker        store.Looker  // store, if it implements store.Looker (lookup.go)
	opts          *options
	obs           *observer
	firstPoll     time.Duration       // awaitFirstPoll; a test of a Watcher makes it long
	reads         reads               // the polls of waiting duplicates under way (await.go)
	batchStore    store.BatchAtomic   // store, if it implements store.BatchAtomic (batch.go)
	batchReserver store.BatchReserver // store, if it implements store.BatchReserver (batch.go)
	partitions    *partitions         // the tenants' of recent calls
}

// New returns an Engine on st, to hand to every entry point that serves the
// store's keys. It returns an error that names the fix for a mistake in opts,
// or a nil st.
func New(st store.Store, opts ...Option) (*Engine, error) {
	if st == nil {
		return nil, errors.New("idemkey: engine.New needs a store, such as memory.New() or postgres.New(pool)")
	}
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	e := &Engine{store: st, opts: o, obs: newObserver(o), firstPoll: awaitFirstPoll,
		reads: reads{byKey: make(map[waited]*read)}, partitions: newPartitions()}
	e.atomic, _ = st.(store.Atomic)
	e.finder, _ = st.(store.Finder)
	e.watcher, _ = st.(store.Watcher)
	e.stepper, _ = st.(store.Stepper)
	e.renewer, _ = st.(store.Renewer)
	e.looker, _ = st.(store.Looker)
	e.batchStore, _ = st.(store.BatchAtomic)
	e.batchReserver, _ = st.(store.BatchReserver)
	return e, nil
}

// MaxRecordSize is the bound on one record in bytes (WithMaxRecordSize).
func (e *Engine) MaxRecordSize() int { return e.opts.maxRecord }

// Logger is the logger of WithLogger, for an entry point's own log records.
func (e *Engine) Logger() *slog.Logger { return e.opts.logger }

// Retention is how long a record is kept (WithRetention).
func (e *Engine) Retention() time.Duration { return e.opts.retention }

// tenantOf is the Exchange's own tenant (OperationSpec.OwnTenant), else
// WithTenant's, else "".
func (c *call) tenantOf(ctx context.Context, x Exchange) (string, error) {
	switch {
	case c.op.ownTenant:
		if t, ok := x.(interface{ Tenant() string }); ok {
			return t.Tenant(), nil
		}
		return "", errNoOwnTenant
	case c.e.opts.tenant != nil:
		return c.e.opts.tenant(ctx)
	}
	return "", nil
}

// Operation is one kind of call an entry point serves: a gRPC method, a
// Connect procedure, an HTTP route. Build it once and reuse it.
type Operation struct {
	name        string
	atomic      bool
	keyRequired bool
	redelivers  bool
	ownTenant   bool
	timeout     time.Duration // HandlerTimeout
	retention   time.Duration // Retention, else WithRetention's
	metrics     *opMetrics
}

// OperationSpec describes an Operation.
type OperationSpec struct {
	// Name names the operation in keys' scope, metrics and logs; entry
	// points give one operation one name, "/package.Service/Method" for a
	// protobuf RPC whatever its transport, so that its keys are shared.
	Name string
	// Atomic runs the calls in one transaction with their record (store.Atomic).
	Atomic  bool
	Metrics MetricsSpec
	// OwnTenant says that each call's Exchange tells its tenant, with a
	// method Tenant() string, in place of WithTenant's: a message's.
	OwnTenant bool
	// HandlerTimeout, if positive, bounds each run of the handler and sets
	// the call's lease to it and a grace period. Operation refuses one that
	// WithMaxLease would cut short.
	HandlerTimeout time.Duration
	// KeyRequired refuses calls without a key, whatever WithKeyRequired says.
	KeyRequired bool
	// Redelivers is true for a broker, which delivers a call answered
	// InProgress again: it is answered at once, to wait out the other run's
	// lease, but its last delivery waits for the key. It never fails open.
	Redelivers bool
	// Retention, if positive, is how long the operation's records are kept,
	// in place of WithRetention's: its keys' expiry, the refusal of a retry
	// first sent longer ago, and the sweep follow it. Operation refuses one
	// shorter than WithMaxLease.
	Retention time.Duration
}

// Operation returns the operation spec describes, or an error that names the
// fix: atomic mode on a store that is not store.Atomic, no tenant, a
// HandlerTimeout longer than WithMaxLease allows, or a Retention shorter.
func (e *Engine) Operation(spec OperationSpec) (*Operation, error) {
	if spec.Atomic && e.atomic == nil {
		return nil, fmt.Errorf("idemkey: atomic mode needs a store that implements store.Atomic, such as store/postgres; %T does not", e.store)
	}
	if t := spec.HandlerTimeout; t > 0 && t > e.opts.maxLease-leaseGrace {
		// The lease would end while the handler may still run, and a
		// redelivery would run it again beside itself.
		return nil, fmt.Errorf("idemkey: operation %q: the handler timeout (%v, consumer.WithHandlerTimeout) needs a lease of %v more, "+
			"but the longest lease is %v (engine.WithMaxLease): a handler still running when its lease ends may run again beside itself; "+
			"give engine.WithMaxLease at least %v, or shorten the timeout", spec.Name, t, leaseGrace, e.opts.maxLease, min(t, math.MaxInt64-leaseGrace)+leaseGrace)
	}
	if !spec.OwnTenant && e.opts.tenant == nil && !e.opts.singleTenant {
		return nil, errNoTenant
	}
	retention := e.opts.retention
	if spec.Retention > 0 {
		retention = spec.Retention
	}
	if retention < e.opts.maxLease {
		return nil, fmt.Errorf("idemkey: operation %q: its retention (%v) is shorter than the longest lease (%v, engine.WithMaxLease): "+
			"a record would expire while its call may still run; lengthen the retention or shorten the maximum lease", spec.Name, retention, e.opts.maxLease)
	}
	return &Operation{name: spec.Name, atomic: spec.Atomic, keyRequired: spec.KeyRequired || e.opts.keyRequired,
		redelivers: spec.Redelivers, ownTenant: spec.OwnTenant, timeout: max(spec.HandlerTimeout, 0), retention: retention,
		metrics: newOpMetrics(spec.Metrics)}, nil
}

// Retention is how long the operation's records are kept: its
// OperationSpec.Retention, else the engine's (WithRetention).
func (op *Operation) Retention() time.Duration { return op.retention }

// Name is the operation's name.
func (op *Operation) Name() string { return op.name }

// Atomic reports whether the operation runs in atomic mode.
func (op *Operation) Atomic() bool { return op.atomic }
