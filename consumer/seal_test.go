package consumer_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/seal"
)

func testRing(t *testing.T, primary byte) *seal.KeyRing {
	t.Helper()
	r, err := seal.NewKeyRing(bytes.Repeat([]byte{primary}, seal.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// A sealed record drops its duplicates as a plain one does; a consumer
// whose ring cannot open it processes nothing again: it negative-acks, and
// dead-letters on the last delivery.
func TestSealedRecords(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			st, modeOpts := open(t)
			logger, logs := logtest.New()
			build := func(ring *seal.KeyRing) *testConsumer {
				return newConsumer(t, st, []engine.Option{engine.WithSealer(ring), engine.WithLogger(logger)}, modeOpts...)
			}
			c := build(testRing(t, 1))
			h := &counter{}
			if res := c.handle(t.Context(), delivery("msg-secret-id", 1), h.handle); res.Outcome != consumer.Processed {
				t.Fatalf("first delivery: %v", res)
			}
			h.err = consumer.Final(errors.New("poison"))
			c.handle(t.Context(), delivery("msg-secret-id-2", 1), h.handle)
			if res := c.handle(t.Context(), delivery("msg-secret-id", 2), h.handle); res.Outcome != consumer.Duplicate || res.DeadLetter {
				t.Fatalf("redelivery: %+v, want a duplicate", res)
			}
			if res := c.handle(t.Context(), delivery("msg-secret-id-2", 2), h.handle); res.Outcome != consumer.Duplicate || !errors.Is(res.Err, consumer.ErrFailedBefore) {
				t.Fatalf("redelivery of the failed one: %+v, want a duplicate that failed before", res)
			}

			other := build(testRing(t, 2))
			res := other.handle(t.Context(), delivery("msg-secret-id", 3), h.handle)
			if res.Outcome != consumer.StoreFailed || res.Action != consumer.Nak {
				t.Fatalf("a record the ring cannot open: %+v, want store unavailable and a nak", res)
			}
			last := delivery("msg-secret-id", 4)
			last.Last = true
			if res := other.handle(t.Context(), last, h.handle); res.Action == consumer.Nak || !res.DeadLetter {
				t.Fatalf("its last delivery: %+v, want it dead-lettered", res)
			}
			if h.runs != 2 {
				t.Fatalf("handler ran %d times, want 2", h.runs)
			}
			if l := logs.String(); !strings.Contains(l, "does not open") || strings.Contains(l, "secret") {
				t.Fatalf("want an Error saying why, with nothing raw:\n%s", l)
			}
		})
	}
}
