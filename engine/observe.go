package engine

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkey/idemkey/store"
)

// instrumentationName names idemkey's meter and tracer.
const instrumentationName = "github.com/idemkey/idemkey/engine"

// Verdict is what became of a call: the value of the idemkey.outcome
// attribute of its metrics, its span and its Debug log line.
type Verdict uint8

const (
	Executed         Verdict = iota // the handler ran under the key (its status tells recorded or released)
	Replayed                        // the recorded outcome was replayed
	InProgress                      // the first call still runs
	Reused                          // the key was first used with another request
	KeyMissing                      // WithKeyRequired and no key
	KeyInvalid                      // a malformed key
	NoKey                           // no key, none required: the handler ran unprotected
	StoreUnavailable                // the store failed; the handler did not run
	StoreFull                       // no room for a new key; the handler did not run
	FailedOpen                      // the store failed and WithFailOpen ran the handler unprotected
	Refused                         // the tenant or the request was refused, or the call cannot be replayed
	Expired                         // the key's operation was first sent longer ago than the retention, and it has no record: not run
	FirstSentInvalid                // the first-sent time is malformed, or in the future: not run
	numVerdicts
)

var verdictNames = [numVerdicts]string{
	"executed", "replayed", "in_progress", "reused", "key_missing", "key_invalid",
	"no_key", "store_unavailable", "store_full", "failed_open", "refused",
	"key_expired", "first_sent_invalid",
}

func (v Verdict) String() string {
	if v >= numVerdicts {
		return "unknown"
	}
	return verdictNames[v]
}

// MetricsSpec is how an operation's measurements are labelled.
type MetricsSpec struct {
	// Attributes of every measurement of the operation, such as otelgrpc's
	// rpc.system.name, rpc.service and rpc.method, so that the two join.
	Attributes []attribute.KeyValue
	// Status is the attribute of a call's final status code, the code End is
	// given: rpc.response.status_code, http.response.status_code. Nil leaves
	// the code out.
	Status func(code int) attribute.KeyValue
}

// storeOp is a kind of store call, the value of idemkey.store.operation.
type storeOp uint8

const (
	opReserve storeOp = iota
	opFind
	opComplete
	opRelease
	opBegin
	opCommit
	opBeginBatch
	opCommitBatch
	opReserveBatch
	numStoreOps
)

var storeOpNames = [numStoreOps]string{"reserve", "find", "complete", "release", "begin", "commit", "begin_batch", "commit_batch", "reserve_batch"}

// observer records the metrics, span attributes and Debug log lines of one
// engine. Its instruments come from WithMeterProvider's provider (the global
// one by default), so with no SDK installed they do nothing, and nothing is
// built for them.
type observer struct {
	calls      metric.Int64Counter     // idemkey.calls
	storeTime  metric.Float64Histogram // idemkey.store.duration
	recordSize metric.Int64Histogram   // idemkey.record.size
	tracer     trace.Tracer
	logger     *slog.Logger

	storeOpts [numStoreOps][2]metric.RecordOption // by operation, and whether it failed
}

func newObserver(o *options) *observer {
	meter := o.meterProvider.Meter(instrumentationName)
	obs := &observer{tracer: o.tracerProvider.Tracer(instrumentationName), logger: o.logger}
	// The API's instruments never fail to be created; on an error the meter
	// still returns a working no-op, so the errors are ignored.
	obs.calls, _ = meter.Int64Counter("idemkey.calls", metric.WithUnit("{call}"),
		metric.WithDescription("Covered calls with an idempotency key or one required, by outcome, operation and final status code."))
	obs.storeTime, _ = meter.Float64Histogram("idemkey.store.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of the idempotency store's operations."),
		metric.WithExplicitBucketBoundaries(store.DurationBuckets...))
	obs.recordSize, _ = meter.Int64Histogram("idemkey.record.size", metric.WithUnit("By"),
		metric.WithDescription("Size of the recorded outcomes."),
		metric.WithExplicitBucketBoundaries(64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304))
	for op := range numStoreOps {
		for failed := range 2 {
			attrs := []attribute.KeyValue{attribute.String("idemkey.store.operation", storeOpNames[op])}
			if failed == 1 {
				attrs = append(attrs, attribute.String("error.type", "store_failed"))
			}
			obs.storeOpts[op][failed] = metric.WithAttributeSet(attribute.NewSet(attrs...))
		}
	}
	return obs
}

// fastCodes is how many status codes have a slot of their own in opMetrics:
// all of gRPC's. Others (HTTP's) go through a map.
const fastCodes = 32

// opMetrics are the attribute sets of one operation's measurements, made on
// first use and kept.
type opMetrics struct {
	spec  MetricsSpec
	calls [numVerdicts][fastCodes]atomic.Pointer[metric.AddOption]
	other sync.Map // verdict<<16 | code -> metric.AddOption, for codes from fastCodes
	size  metric.RecordOption
}

func newOpMetrics(spec MetricsSpec) *opMetrics {
	return &opMetrics{spec: spec, size: metric.WithAttributeSet(attribute.NewSet(spec.Attributes...))}
}

func (mm *opMetrics) callOption(v Verdict, code int) metric.AddOption {
	var slot *atomic.Pointer[metric.AddOption]
	if code >= 0 && code < fastCodes {
		slot = &mm.calls[v][code]
		if opt := slot.Load(); opt != nil {
			return *opt
		}
	} else if opt, ok := mm.other.Load(int(v)<<16 | code); ok {
		return opt.(metric.AddOption)
	}
	attrs := append(append(make([]attribute.KeyValue, 0, len(mm.spec.Attributes)+2), mm.spec.Attributes...),
		attribute.String("idemkey.outcome", v.String()))
	if mm.spec.Status != nil {
		attrs = append(attrs, mm.spec.Status(code))
	}
	opt := metric.AddOption(metric.WithAttributeSet(attribute.NewSet(attrs...)))
	if slot != nil {
		slot.Store(&opt)
	} else {
		mm.other.Store(int(v)<<16|code, opt)
	}
	return opt
}

// callEnded records how a call ended: its counter, the attributes and an
// event on the call's span (otelgrpc's, if any), and a Debug line.
func (obs *observer) callEnded(ctx context.Context, c *call, code int) {
	if obs.calls.Enabled(ctx) {
		obs.calls.Add(ctx, 1, c.op.metrics.callOption(c.Verdict, code))
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attribute.String("idemkey.outcome", c.Verdict.String()))
		span.AddEvent("idemkey." + c.Verdict.String())
	}
	if obs.logger.Enabled(ctx, slog.LevelDebug) {
		attrs := []slog.Attr{slog.String("outcome", c.Verdict.String()), slog.String("operation", c.op.name)}
		if c.op.metrics.spec.Status != nil {
			attrs = append(attrs, slog.String("code", c.op.metrics.spec.Status(code).Value.String()))
		}
		attrs = append(attrs, slog.Duration("took", time.Since(c.began)))
		if c.started {
			attrs = append(attrs, slog.String("scope", c.key.String()))
		}
		obs.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey: call", attrs...)
	}
}

// recorded notes the size of an outcome written to the store.
func (obs *observer) recorded(ctx context.Context, op *Operation, size int) {
	if obs.recordSize.Enabled(ctx) {
		obs.recordSize.Record(ctx, int64(size), op.metrics.size)
	}
}

// storeTimer measures one store operation, in a span of its own when the
// call's span is recording.
type storeTimer struct {
	obs   *observer
	op    storeOp
	start time.Time
	span  trace.Span // nil if not traced
}

// startStore starts measuring op; ctx is what the store call gets. It
// reads the clock only for a histogram that records (an SDK's).
func (obs *observer) startStore(ctx context.Context, op storeOp) (context.Context, storeTimer) {
	t := storeTimer{obs: obs, op: op}
	if obs.storeTime.Enabled(ctx) {
		t.start = time.Now()
	}
	if trace.SpanFromContext(ctx).IsRecording() {
		ctx, t.span = obs.tracer.Start(ctx, "idemkey.store."+storeOpNames[op], trace.WithSpanKind(trace.SpanKindInternal))
	}
	return ctx, t
}

// end records the operation's duration, and whether err failed it. A lost
// lease, or a full store, is an answer, not a failure.
func (t storeTimer) end(ctx context.Context, err error) {
	failed := 0
	if err != nil && !errors.Is(err, store.ErrLeaseLost) && !errors.Is(err, store.ErrFull) {
		failed = 1
	}
	if !t.start.IsZero() && t.obs.storeTime.Enabled(ctx) {
		t.obs.storeTime.Record(ctx, time.Since(t.start).Seconds(), t.obs.storeOpts[t.op][failed])
	}
	if t.span != nil {
		if err != nil {
			t.span.SetStatus(codes.Error, storeErrorKind(err)) // never the text, which may come from a driver
		}
		t.span.End()
	}
}

// storeErrorKind names the kind of a store's error.
func storeErrorKind(err error) string {
	switch {
	case errors.Is(err, store.ErrLeaseLost):
		return "lease lost"
	case errors.Is(err, store.ErrFull):
		return "store full"
	case errors.Is(err, store.ErrDataLost):
		return "store data lost"
	}
	return "store failed"
}

// The engine's store calls, each measured. With a sealer (WithSealer), the
// outcomes they write are sealed and those they read opened (seal.go); the
// time measured is the store's alone.

func (e *Engine) reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	r = e.roomFor(r)
	sctx, t := e.obs.startStore(ctx, opReserve)
	res, err := e.store.Reserve(sctx, r)
	t.end(ctx, err)
	if err != nil {
		return res, err
	}
	return e.opened(r.Key, &r.Fingerprint, res)
}

func (e *Engine) find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	sctx, t := e.obs.startStore(ctx, opFind)
	res, found, err := e.finder.Find(sctx, key)
	t.end(ctx, err)
	if err != nil || !found {
		return res, found, err
	}
	res, err = e.opened(key, nil, res)
	return res, err == nil, err
}

func (e *Engine) begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	r = e.roomFor(r)
	sctx, t := e.obs.startStore(ctx, opBegin)
	res, tx, err := e.atomic.Begin(sctx, r)
	t.end(ctx, err)
	if err != nil {
		return res, tx, err
	}
	if tx != nil && e.sealer() != nil {
		tx = sealingTx{Tx: tx, e: e, key: r.Key}
	}
	res, err = e.opened(r.Key, &r.Fingerprint, res)
	return res, tx, err
}

// commit seals the outcome in c.tx's Commit (sealingTx), whose time it counts.
func (e *Engine) commit(ctx context.Context, c *call, outcome []byte, keepWrites bool) error {
	sctx, t := e.obs.startStore(ctx, opCommit)
	err := c.tx.Commit(sctx, outcome, keepWrites)
	t.end(ctx, err)
	c.noteWrite(len(outcome), err)
	return err
}

// complete and storeRelease detach the write from the caller's cancellation
// (see call.Record), after the span lookup, which costs an allocation on a
// detached context.
func (e *Engine) complete(ctx context.Context, c *call, outcome []byte) error {
	size := len(outcome) // for the hooks: the adapter's encoding, as replays get it
	outcome, err := e.sealOutcome(c.key, outcome)
	if err == nil {
		sctx, t := e.obs.startStore(ctx, opComplete)
		err = e.store.Complete(context.WithoutCancel(sctx), c.key, c.token, outcome)
		t.end(ctx, err)
	}
	c.noteWrite(size, err)
	return err
}

func (e *Engine) storeRelease(ctx context.Context, c *call) error {
	sctx, t := e.obs.startStore(ctx, opRelease)
	err := e.store.Release(context.WithoutCancel(sctx), c.key, c.token)
	t.end(ctx, err)
	return err
}
