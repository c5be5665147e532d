package interceptor

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/store"
)

// instrumentationName names idemkey's meter and tracer.
const instrumentationName = "github.com/idemkey/idemkey/interceptor"

// verdict is what became of a covered call: the value of the idemkey.outcome
// attribute of its metrics, its span and its Debug log line.
type verdict uint8

const (
	verdictExecuted         verdict = iota // the handler ran under the key (its status tells recorded or released)
	verdictReplayed                        // the recorded outcome was replayed
	verdictInProgress                      // Aborted: the first call still runs
	verdictReused                          // InvalidArgument: the key was first used with another request
	verdictKeyMissing                      // InvalidArgument: WithKeyRequired and no key
	verdictKeyInvalid                      // InvalidArgument: a malformed key
	verdictNoKey                           // no key, none required: the handler ran unprotected
	verdictStoreUnavailable                // Unavailable: the store failed, the handler did not run
	verdictStoreFull                       // ResourceExhausted: no room for a new key
	verdictFailedOpen                      // the store failed and WithFailOpen ran the handler unprotected
	verdictRefused                         // the TenantFunc or FingerprintFunc refused, or the method cannot be replayed
	numVerdicts
)

var verdictNames = [numVerdicts]string{
	"executed", "replayed", "in_progress", "reused", "key_missing", "key_invalid",
	"no_key", "store_unavailable", "store_full", "failed_open", "refused",
}

func (v verdict) String() string { return verdictNames[v] }

// storeOp is a kind of store call, the value of idemkey.store.operation.
type storeOp uint8

const (
	opReserve storeOp = iota
	opFind
	opComplete
	opRelease
	opBegin
	opCommit
	numStoreOps
)

var storeOpNames = [numStoreOps]string{"reserve", "find", "complete", "release", "begin", "commit"}

// numCodes is the number of gRPC status codes, OK to Unauthenticated.
const numCodes = int(grpccodes.Unauthenticated) + 1

// observer records the metrics, span attributes and Debug log lines of one
// interceptor. Its instruments come from WithMeterProvider's provider (the
// global one by default), so with no SDK installed they do nothing, and
// nothing is built for them.
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
		metric.WithDescription("Covered calls with an idempotency key or one required, by outcome, method and final status code."))
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

// methodMetrics are the attribute sets of one method's measurements, made on
// first use and kept: the methods of a gRPC server are few.
type methodMetrics struct {
	attrs []attribute.KeyValue // rpc.system.name, rpc.service, rpc.method
	calls [numVerdicts][numCodes]atomic.Pointer[metric.AddOption]
	size  atomic.Pointer[metric.RecordOption]
}

func newMethodMetrics(fullMethod string) *methodMetrics {
	// As otelgrpc labels its own metrics, so that the two can be joined:
	// rpc.method is "package.Service/Method".
	method := strings.TrimPrefix(fullMethod, "/")
	service, _, _ := strings.Cut(method, "/")
	return &methodMetrics{attrs: []attribute.KeyValue{
		attribute.String("rpc.system.name", "grpc"),
		attribute.String("rpc.service", service),
		attribute.String("rpc.method", method),
	}}
}

func (mm *methodMetrics) callOption(o verdict, code grpccodes.Code) metric.AddOption {
	if int(code) >= numCodes {
		code = grpccodes.Unknown
	}
	slot := &mm.calls[o][code]
	if opt := slot.Load(); opt != nil {
		return *opt
	}
	attrs := append(append([]attribute.KeyValue(nil), mm.attrs...),
		attribute.String("idemkey.outcome", o.String()),
		attribute.String("rpc.response.status_code", rpccode.Code(code).String())) // "OK", "INVALID_ARGUMENT", as otelgrpc
	opt := metric.AddOption(metric.WithAttributeSet(attribute.NewSet(attrs...)))
	slot.Store(&opt)
	return opt
}

func (mm *methodMetrics) sizeOption() metric.RecordOption {
	if opt := mm.size.Load(); opt != nil {
		return *opt
	}
	opt := metric.RecordOption(metric.WithAttributeSet(attribute.NewSet(mm.attrs...)))
	mm.size.Store(&opt)
	return opt
}

// callEnded records how a covered call ended: its counter, the attributes
// and an event on the call's span (otelgrpc's, if any), and a Debug line.
func (obs *observer) callEnded(ctx context.Context, m *method, c *call, o verdict, err error, start time.Time) {
	code := grpccodes.OK
	if err != nil {
		code = status.Code(err)
	}
	if obs.calls.Enabled(ctx) {
		obs.calls.Add(ctx, 1, m.metrics.callOption(o, code))
	}
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attribute.String("idemkey.outcome", o.String()))
		span.AddEvent("idemkey." + o.String())
	}
	if obs.logger.Enabled(ctx, slog.LevelDebug) {
		attrs := []slog.Attr{slog.String("outcome", o.String()), slog.String("method", m.name),
			slog.String("code", code.String()), slog.Duration("took", time.Since(start))}
		if c != nil {
			attrs = append(attrs, slog.String("scope", c.key.String()))
		}
		obs.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey: call", attrs...)
	}
}

// recorded notes the size of an outcome written to the store.
func (obs *observer) recorded(ctx context.Context, m *method, size int) {
	if obs.recordSize.Enabled(ctx) {
		obs.recordSize.Record(ctx, int64(size), m.metrics.sizeOption())
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

// startStore starts measuring op; ctx is what the store call gets.
func (obs *observer) startStore(ctx context.Context, op storeOp) (context.Context, storeTimer) {
	t := storeTimer{obs: obs, op: op, start: time.Now()}
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
	if t.obs.storeTime.Enabled(ctx) {
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
	}
	return "store failed"
}

// The server's store calls, each measured.

func (s *server) reserve(ctx context.Context, r store.Reservation) (store.Result, error) {
	sctx, t := s.obs.startStore(ctx, opReserve)
	res, err := s.store.Reserve(sctx, r)
	t.end(ctx, err)
	return res, err
}

func (s *server) find(ctx context.Context, key store.Key) (store.Result, bool, error) {
	sctx, t := s.obs.startStore(ctx, opFind)
	res, found, err := s.finder.Find(sctx, key)
	t.end(ctx, err)
	return res, found, err
}

func (s *server) begin(ctx context.Context, r store.Reservation) (store.Result, store.Tx, error) {
	sctx, t := s.obs.startStore(ctx, opBegin)
	res, tx, err := s.atomic.Begin(sctx, r)
	t.end(ctx, err)
	return res, tx, err
}

func (s *server) commit(ctx context.Context, tx store.Tx, outcome []byte, keepWrites bool) error {
	sctx, t := s.obs.startStore(ctx, opCommit)
	err := tx.Commit(sctx, outcome, keepWrites)
	t.end(ctx, err)
	return err
}

// storeComplete and storeRelease detach the write from the caller's
// cancellation (see complete), after the span lookup, which costs an
// allocation on a detached context.
func (s *server) storeComplete(ctx context.Context, c call, outcome []byte) error {
	sctx, t := s.obs.startStore(ctx, opComplete)
	err := s.store.Complete(context.WithoutCancel(sctx), c.key, c.token, outcome)
	t.end(ctx, err)
	return err
}

func (s *server) storeRelease(ctx context.Context, c call) error {
	sctx, t := s.obs.startStore(ctx, opRelease)
	err := s.store.Release(context.WithoutCancel(sctx), c.key, c.token)
	t.end(ctx, err)
	return err
}
