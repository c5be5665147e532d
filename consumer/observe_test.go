package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/memory"
)

// TestMetrics: every delivery is counted in idemkey.calls by its verdict and
// the broker action, so dropped duplicates show as outcome "replayed" with
// action "ack".
func TestMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	c := newConsumerOn(t, testBroker{system: "nats"}, memory.New(), []engine.Option{engine.WithLogger(nil),
		engine.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))})
	ok := func(context.Context) error { return nil }
	c.handle(t.Context(), delivery("a", 1), ok)
	c.handle(t.Context(), delivery("a", 2), ok)
	c.handle(t.Context(), delivery("a", 3), ok)
	c.handle(t.Context(), delivery("b", 1), func(context.Context) error { return errors.New("down") })
	c.handle(t.Context(), delivery("", 1), ok)

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.calls" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				var parts []string
				for _, kv := range dp.Attributes.ToSlice() {
					parts = append(parts, string(kv.Key)+"="+kv.Value.String())
				}
				got = append(got, fmt.Sprintf("%s: %d", strings.Join(parts, " "), dp.Value))
			}
		}
	}
	slices.Sort(got)
	const labels = "messaging.consumer.group.name=charges messaging.system=nats"
	want := []string{
		"idemkey.message.action=ack idemkey.outcome=executed " + labels + ": 1",
		"idemkey.message.action=ack idemkey.outcome=replayed " + labels + ": 2",
		"idemkey.message.action=nak idemkey.outcome=executed " + labels + ": 1",
		"idemkey.message.action=reject idemkey.outcome=key_missing " + labels + ": 1",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("idemkey.calls:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
