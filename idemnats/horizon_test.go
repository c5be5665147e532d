package idemnats

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestHorizon(t *testing.T) {
	day := 24 * time.Hour
	for _, tc := range []struct {
		name      string
		stream    jetstream.StreamConfig
		cons      jetstream.ConsumerConfig
		unbounded bool
		bound     time.Duration
	}{
		{"defaults", jetstream.StreamConfig{}, jetstream.ConsumerConfig{MaxDeliver: -1, AckWait: 30 * time.Second}, true, 0},
		{"max age", jetstream.StreamConfig{MaxAge: 3 * day}, jetstream.ConsumerConfig{MaxDeliver: -1}, false, 3 * day},
		{"max deliver", jetstream.StreamConfig{}, jetstream.ConsumerConfig{MaxDeliver: 10, AckWait: 2 * time.Minute}, false, 20 * time.Minute},
		{"backoff", jetstream.StreamConfig{}, jetstream.ConsumerConfig{MaxDeliver: 3, AckWait: time.Second, BackOff: []time.Duration{time.Second, time.Hour}}, false, 3 * time.Hour},
		{"nak delay", jetstream.StreamConfig{}, jetstream.ConsumerConfig{MaxDeliver: 5, AckWait: time.Second}, false, 5 * time.Minute},
		{"the shorter", jetstream.StreamConfig{MaxAge: time.Hour}, jetstream.ConsumerConfig{MaxDeliver: 1000, AckWait: time.Minute}, false, time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := redeliveryHorizon(tc.stream, tc.cons, time.Minute)
			if h.Unbounded != tc.unbounded || h.Bound != tc.bound {
				t.Fatalf("horizon %+v, want unbounded %v, bound %s", h, tc.unbounded, tc.bound)
			}
		})
	}
}
