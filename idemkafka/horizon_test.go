package idemkafka

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestHorizon(t *testing.T) {
	day := 24 * time.Hour
	for _, tc := range []struct {
		name      string
		cfg       map[string]string
		unbounded bool
		bound     time.Duration
	}{
		{"kafka's defaults", map[string]string{}, false, 14 * day},
		{"set", map[string]string{"retention.ms": "259200000", "segment.ms": "86400000"}, false, 4 * day},
		{"for ever", map[string]string{"retention.ms": "-1"}, true, 0},
		{"compacted", map[string]string{"cleanup.policy": "compact"}, true, 0},
		{"compacted and deleted", map[string]string{"cleanup.policy": "compact,delete", "retention.ms": "3600000", "segment.ms": "0"}, false, time.Hour},
		{"too long to add", map[string]string{"retention.ms": "9223372036854775807", "segment.ms": "86400000"}, false, time.Duration(math.MaxInt64)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := redeliveryHorizon("orders", tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if h.Unbounded != tc.unbounded || h.Bound != tc.bound {
				t.Fatalf("horizon %+v, want unbounded %v, bound %s", h, tc.unbounded, tc.bound)
			}
			if !strings.Contains(h.Fix, "orders") || !strings.Contains(h.Fix, "retention.ms") {
				t.Fatalf("fix %q names neither the topic nor retention.ms", h.Fix)
			}
		})
	}
	if _, err := redeliveryHorizon("orders", map[string]string{"retention.ms": "a week"}); err == nil || !strings.Contains(err.Error(), "retention.ms") {
		t.Fatalf("a retention.ms that is not a number: %v, want an error naming it", err)
	}
}
