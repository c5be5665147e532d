package idemconnect_test

import (
	"fmt"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/engine"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// The engine counts Connect calls as it counts gRPC ones, labelled with the
// stable RPC conventions and rpc.system.name "connectrpc".
func TestMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	runs := &counter{}
	client := newChargeClient(t, serve(t, runs.handle, newInterceptor(t, single(t, engine.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))))))
	for _, amount := range []int64{100, 100, 200} { // executed, replayed, reused
		_, _ = call(t.Context(), client, "k1", &paymentsv1.CreateChargeRequest{Amount: amount})
	}
	_, _ = call(t.Context(), client, "", &paymentsv1.CreateChargeRequest{Amount: 100}) // no key

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.calls" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				attr := func(k string) string { v, _ := dp.Attributes.Value(attribute.Key(k)); return v.String() }
				got[fmt.Sprintf("%s %s %s %s %s", attr("rpc.system.name"), attr("rpc.service"), attr("rpc.method"),
					attr("idemkey.outcome"), attr("rpc.response.status_code"))] += dp.Value
			}
		}
	}
	const prefix = "connectrpc example.payments.v1.PaymentService example.payments.v1.PaymentService/CreateCharge "
	want := map[string]int64{
		prefix + "executed OK":             1,
		prefix + "replayed OK":             1,
		prefix + "reused INVALID_ARGUMENT": 1,
		prefix + "no_key OK":               1,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("idemkey.calls = %v, want %v", got, want)
	}
}
