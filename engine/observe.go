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

// MetricsSpec is how an operation's measurements are labelled.
type MetricsSpec struct {
	// Attributes of every measurement of the operation, such as otelgrpc's
	// rpc.system.name, rpc.service and rpc.method, so that the two join.
	Attributes []attribute.KeyValue
	// Status is the attribute of a call's final status code, the code
	// Exchange.Answer or Exchange.Pass returned: rpc.response.status_code, http.response.status_code. Nil leaves
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
