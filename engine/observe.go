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

const instrumentationName = "github.com/idemkey/idemkey/engine"

// MetricsSpec is how an operation's measurements are labelled.
type MetricsSpec struct {
	// Attributes of every measurement, such as otelgrpc's rpc.method, so
	// that the two join.
	Attributes []attribute.KeyValue
	// Status is the attribute of the code Exchange.Answer or Pass returned
	// (rpc.response.status_code); nil leaves it out.
	Status func(code int) attribute.KeyValue
}

// storeOp is the value of idemkey.store.operation.
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
	opStartStep
	opFinishStep
	opForgetSteps
	opRenew
	opLookup
	numStoreOps
)

var storeOpNames = [numStoreOps]string{"reserve", "find", "complete", "release", "begin", "commit", "begin_batch", "commit_batch", "reserve_batch",
	"start_step", "finish_step", "forget_steps", "renew", "lookup"}

// observer records one engine's metrics, span attributes and Debug lines.
// With no SDK installed its instruments do nothing, and nothing is built.
type observer struct {
	calls      metric.Int64Counter     // idemkey.calls
	storeTime  metric.Float64Histogram // idemkey.store.duration
	recordSize metric.Int64Histogram   // idemkey.record.size
	tracer     trace.Tracer
	logger     *slog.Logger
	storeOpts  [numStoreOps][2]metric.RecordOption // by operation, and whether it failed
}

func newObserver(o *options) *observer {
	meter := o.meterProvider.Meter(instrumentationName)
	obs := &observer{tracer: o.tracerProvider.Tracer(instrumentationName), logger: o.logger}
	// On an error the meter still returns a working no-op.
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

// fastCodes: gRPC's codes have a slot each in opMetrics; others (HTTP's) a map.
const fastCodes = 32

// opMetrics are one operation's attribute sets, made on first use and kept.
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

// callEnded records the call's counter, the outcome on its span, and a Debug
// line.
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

func (obs *observer) recorded(ctx context.Context, op *Operation, size int) {
	if obs.recordSize.Enabled(ctx) {
		obs.recordSize.Record(ctx, int64(size), op.metrics.size)
	}
}

// storeTimer measures one store call, in a span only under a recording one.
type storeTimer struct {
	obs   *observer
	op    storeOp
	start time.Time
	span  trace.Span // nil if not traced
}

// startStore reads the clock only for a histogram that records.
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

// end records the duration; a lost lease or a full store is an answer, not
// a failure.
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
