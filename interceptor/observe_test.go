package interceptor_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/engine"

	otelcodes "go.opentelemetry.io/otel/codes"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// telemetry is an OpenTelemetry SDK that keeps what it is given, for tests.
type telemetry struct {
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
	meters *sdkmetric.MeterProvider
	traces *sdktrace.TracerProvider
}

// spanPerCall opens a span for each call, named and ended as otelgrpc's
// server handler does, with the call's status as its own: idemkey adds to the
// span that is already active and opens none of its own.
func (tm *telemetry) spanPerCall(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, span := tm.traces.Tracer("test").Start(ctx, strings.TrimPrefix(info.FullMethod, "/"))
	defer span.End()
	resp, err := handler(ctx, req)
	if err != nil {
		span.SetStatus(otelcodes.Error, status.Convert(err).Message())
	}
	return resp, err
}

func newTelemetry() *telemetry {
	t := &telemetry{reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	t.meters = sdkmetric.NewMeterProvider(sdkmetric.WithReader(t.reader))
	t.traces = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(t.spans))
	return t
}

func (tm *telemetry) options() []any {
	return []any{engine.WithMeterProvider(tm.meters), engine.WithTracerProvider(tm.traces)}
}

func (tm *telemetry) collect(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := tm.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	return rm
}

// metric returns the data of the metric named name, or nil.
func metric(rm metricdata.ResourceMetrics, name string) metricdata.Aggregation {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m.Data
			}
		}
	}
	return nil
}

// calls sums idemkey.calls by method, outcome and final status code.
func calls(rm metricdata.ResourceMetrics) map[string]int64 {
	out := map[string]int64{}
	sum, _ := metric(rm, "idemkey.calls").(metricdata.Sum[int64])
	for _, dp := range sum.DataPoints {
		outcome, _ := dp.Attributes.Value("idemkey.outcome")
		code, _ := dp.Attributes.Value("rpc.response.status_code")
		method, _ := dp.Attributes.Value("rpc.method")
		out[fmt.Sprintf("%s %s %s", method.AsString(), outcome.AsString(), code.AsString())] += dp.Value
	}
	return out
}

// storeOps counts the store operations idemkey.store.duration measured, by
// operation.
func storeOps(rm metricdata.ResourceMetrics) map[string]uint64 {
	out := map[string]uint64{}
	histogram, _ := metric(rm, "idemkey.store.duration").(metricdata.Histogram[float64])
	for _, dp := range histogram.DataPoints {
		op, _ := dp.Attributes.Value("idemkey.store.operation")
		out[op.AsString()] += dp.Count
	}
	return out
}

// Each way a covered call can end moves its own counter, labelled with the
// method and the final status code; the store's operations are timed and the
// recorded outcomes measured; the call's span (as otelgrpc would open it) gets the outcome.
func TestMetricsCountOutcomes(t *testing.T) {
	tm := newTelemetry()
	svc := newService()
	st := memory.New(memory.WithMaxRecords(3), memory.WithTenantShare(1)) // three records, all acme's
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(tm.spanPerCall,
			grpctest.Interceptor(st, append(tm.options(),
				engine.WithTenant(tenantFromMetadata), engine.WithKeyRequired(), engine.WithInProgressWait(0))...)))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	acme := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	call := func(ctx context.Context, key string, amount int64) error {
		if key != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
		}
		_, err := client.CreateCharge(ctx, request(amount))
		return err
	}

	_ = call(acme, "k1", 1)                 // executed
	_ = call(acme, "k1", 1)                 // replayed
	_ = call(acme, "k1", 2)                 // reused
	_ = call(acme, "", 1)                   // key missing
	_ = call(acme, "sp ace", 1)             // key invalid
	_ = call(context.Background(), "k2", 1) // refused: no tenant
	started, release := svc.block()
	done := make(chan error)
	go func() { done <- call(acme, "k3", 1) }()
	<-started
	_ = call(acme, "k3", 1) // in progress
	close(release)
	<-done
	svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return chargeFor(req, 1), nil
	}
	_ = call(acme, "k4", 1) // executed: the third and last record
	_ = call(acme, "k5", 1) // store full

	got := calls(tm.collect(t))
	for _, want := range []string{
		"example.payments.v1.PaymentService/CreateCharge executed OK", "example.payments.v1.PaymentService/CreateCharge replayed OK", "example.payments.v1.PaymentService/CreateCharge reused INVALID_ARGUMENT",
		"example.payments.v1.PaymentService/CreateCharge key_missing INVALID_ARGUMENT", "example.payments.v1.PaymentService/CreateCharge key_invalid INVALID_ARGUMENT",
		"example.payments.v1.PaymentService/CreateCharge refused UNAUTHENTICATED", "example.payments.v1.PaymentService/CreateCharge in_progress ABORTED",
		"example.payments.v1.PaymentService/CreateCharge store_full RESOURCE_EXHAUSTED",
	} {
		if got[want] < 1 {
			t.Errorf("no call counted as %q; counted: %v", want, got)
		}
	}
	if got["example.payments.v1.PaymentService/CreateCharge executed OK"] != 3 || got["example.payments.v1.PaymentService/CreateCharge replayed OK"] != 1 {
		t.Errorf("executed %d and replayed %d, want 3 and 1: %v", got["example.payments.v1.PaymentService/CreateCharge executed OK"], got["example.payments.v1.PaymentService/CreateCharge replayed OK"], got)
	}
	ops := storeOps(tm.collect(t))
	if ops["reserve"] < 5 || ops["complete"] != 3 {
		t.Errorf("store operations timed: %v; want reserve for every keyed call, complete for each of the 3 runs", ops)
	}

	var outcomes []string
	for _, span := range tm.spans.Ended() {
		for _, kv := range span.Attributes() {
			if kv.Key == "idemkey.outcome" {
				outcomes = append(outcomes, span.Name()+" "+kv.Value.AsString())
			}
		}
	}
	if !strings.Contains(strings.Join(outcomes, ","), "example.payments.v1.PaymentService/CreateCharge replayed") {
		t.Errorf("the calls' spans carry the outcomes %q, want a replayed one among them", outcomes)
	}
}

// A store that fails is counted as such, and so is failing open.
func TestMetricsCountStoreFailures(t *testing.T) {
	for name, tc := range map[string]struct {
		opts []any
		want string
	}{
		"closed": {nil, "example.payments.v1.PaymentService/CreateCharge store_unavailable UNAVAILABLE"},
		"open":   {[]any{engine.WithFailOpen()}, "example.payments.v1.PaymentService/CreateCharge failed_open OK"},
	} {
		t.Run(name, func(t *testing.T) {
			tm := newTelemetry()
			intercept := grpctest.Interceptor(failingStore{}, append(tm.options(), tc.opts...)...)
			d := &direct{intercept: intercept, svc: newService()}
			_, _, _ = d.create(t, "k1", request(1))
			if got := calls(tm.collect(t)); got[tc.want] != 1 {
				t.Errorf("counted %v, want one %q", got, tc.want)
			}
		})
	}
}

// No metric or span attribute holds a raw key, tenant, request field or the
// key's hash: they would leak, and make a series per call.
func TestNothingRawInTelemetry(t *testing.T) {
	tm := newTelemetry()
	svc := newService()
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(tm.spanPerCall,
			grpctest.Interceptor(memory.New(), append(tm.options(), engine.WithTenant(tenantFromMetadata))...)))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	const key, tenant, customer = "secret-key-4242", "tenant-xyzzy", "cus_plugh"
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", tenant, idemkey.KeyMetadata, key)
	req := &paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 1, Currency: "EUR"}
	for range 2 {
		if _, err := client.CreateCharge(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	secrets := []string{key, tenant, customer, store.ScopeKey(tenant, createCharge, key).String()}
	var values []string
	collectSet := func(set attribute.Set) {
		for _, kv := range set.ToSlice() {
			values = append(values, kv.Value.String())
		}
	}
	for _, sm := range tm.collect(t).ScopeMetrics {
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range data.DataPoints {
					collectSet(dp.Attributes)
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					collectSet(dp.Attributes)
				}
			case metricdata.Histogram[int64]:
				for _, dp := range data.DataPoints {
					collectSet(dp.Attributes)
				}
			}
		}
	}
	for _, span := range tm.spans.Ended() {
		values = append(values, span.Name(), span.Status().Description)
		collectSet(attribute.NewSet(span.Attributes()...))
		for _, e := range span.Events() {
			values = append(values, e.Name)
			collectSet(attribute.NewSet(e.Attributes...))
		}
	}
	if len(values) == 0 {
		t.Fatal("no telemetry was recorded")
	}
	for _, v := range values {
		for _, secret := range secrets {
			if strings.Contains(v, secret) {
				t.Errorf("telemetry holds %q: %q", secret, v)
			}
		}
	}
}

// At Debug level each covered call logs one line with its outcome, method,
// code and scope prefix; at Info, none.
func TestDebugLinePerCall(t *testing.T) {
	for _, debug := range []bool{true, false} {
		buf := &logtest.Buffer{}
		level := slog.LevelInfo
		if debug {
			level = slog.LevelDebug
		}
		logger := slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: level}))
		st := memory.New()
		d := &direct{intercept: grpctest.Interceptor(st, engine.WithTenant(tenantFromMetadata), engine.WithLogger(logger)), store: st, svc: newService()}
		for range 2 {
			if _, _, err := d.create(t, "key-1", request(1)); err != nil {
				t.Fatal(err)
			}
		}
		lines := strings.Count(buf.String(), "idemkey: call")
		switch {
		case debug && (lines != 2 || !strings.Contains(buf.String(), "outcome=executed") || !strings.Contains(buf.String(), "outcome=replayed") ||
			!strings.Contains(buf.String(), "scope="+store.ScopeKey("acme", createCharge, "key-1").String())):
			t.Errorf("at Debug, the log is\n%s\nwant a line per call with its outcome and scope", buf.String())
		case !debug && lines != 0:
			t.Errorf("at Info, %d call lines were logged", lines)
		}
	}
}
