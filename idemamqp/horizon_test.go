package idemamqp

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
)

func TestHorizon(t *testing.T) {
	bounded := func(d time.Duration) consumer.Horizon {
		return consumer.Horizon{Bound: d, Source: "queue q: x-message-ttl"}
	}
	for _, tc := range []struct {
		name string
		args amqp.Table
		want consumer.Horizon
	}{
		{"no args", nil, consumer.Horizon{Unbounded: true, Source: "queue q has no x-message-ttl"}},
		{"no ttl", amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": 5}, consumer.Horizon{Unbounded: true, Source: "queue q has no x-message-ttl"}},
		{"int", amqp.Table{"x-message-ttl": 60_000}, bounded(time.Minute)},
		{"int8", amqp.Table{"x-message-ttl": int8(100)}, bounded(100 * time.Millisecond)},
		{"int16", amqp.Table{"x-message-ttl": int16(1000)}, bounded(time.Second)},
		{"int32", amqp.Table{"x-message-ttl": int32(3_600_000)}, bounded(time.Hour)},
		{"int64 (as read from the broker)", amqp.Table{"x-message-ttl": int64(86_400_000)}, bounded(24 * time.Hour)},
		{"uint8", amqp.Table{"x-message-ttl": uint8(10)}, bounded(10 * time.Millisecond)},
		{"uint16", amqp.Table{"x-message-ttl": uint16(1000)}, bounded(time.Second)},
		{"uint32", amqp.Table{"x-message-ttl": uint32(1000)}, bounded(time.Second)},
		{"uint64 beyond a Duration", amqp.Table{"x-message-ttl": uint64(math.MaxUint64)}, bounded(math.MaxInt64)},
		{"zero", amqp.Table{"x-message-ttl": int32(0)}, bounded(0)},
		{"float64", amqp.Table{"x-message-ttl": 60_000.0}, consumer.Horizon{Unbounded: true, Source: "queue q: x-message-ttl is a float64, not an integer of milliseconds"}},
		{"string", amqp.Table{"x-message-ttl": "60000"}, consumer.Horizon{Unbounded: true, Source: "queue q: x-message-ttl is a string, not an integer of milliseconds"}},
		{"nil", amqp.Table{"x-message-ttl": nil}, consumer.Horizon{Unbounded: true, Source: "queue q: x-message-ttl is a <nil>, not an integer of milliseconds"}},
		{"negative", amqp.Table{"x-message-ttl": -1}, consumer.Horizon{Unbounded: true, Source: "queue q: x-message-ttl is negative"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := redeliveryHorizon("q", tc.args)
			if !strings.Contains(got.Fix, "x-message-ttl") {
				t.Errorf("Horizon's Fix %q does not say what bounds it", got.Fix)
			}
			if got.Fix = ""; got != tc.want {
				t.Errorf("Horizon = %+v; want %+v", got, tc.want)
			}
		})
	}
}

func TestNew(t *testing.T) {
	handler := func(ctx context.Context, d amqp.Delivery) error { return nil }
	for _, tc := range []struct {
		name      string
		args      amqp.Table
		retention time.Duration
		warn      bool
		unbounded bool   // want a *consumer.HorizonError of an unbounded horizon
		bounded   bool   // want a *consumer.HorizonError of a horizon too long
		malformed string // want an error that says this
	}{
		{name: "ttl within the retention", args: amqp.Table{"x-message-ttl": int64(time.Hour / time.Millisecond)}, retention: time.Hour},
		{name: "no ttl", unbounded: true},
		{name: "no ttl, accepted", warn: true},
		{name: "ttl beyond the retention", args: amqp.Table{"x-message-ttl": int32(2 * time.Hour / time.Millisecond)}, retention: time.Hour, bounded: true},
		{name: "ttl beyond the retention, accepted", args: amqp.Table{"x-message-ttl": int32(2 * time.Hour / time.Millisecond)}, retention: time.Hour, warn: true},
		{name: "float ttl", args: amqp.Table{"x-message-ttl": 1000.0}, malformed: "x-message-ttl is a float64"},
		{name: "negative ttl, despite the warning", args: amqp.Table{"x-message-ttl": int64(-5)}, warn: true, malformed: "x-message-ttl is negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logger, logs := logtest.New()
			eopts := []engine.Option{engine.WithLogger(logger), engine.WithRetention(consumer.RecommendedRetention)}
			if tc.retention > 0 {
				eopts = append(eopts, engine.WithRetention(tc.retention))
			}
			opts := []consumer.Option{consumer.WithDiscardDeadLetters()} // TestNoDeadLetter has none
			if tc.warn {
				opts = append(opts, consumer.WithHorizonWarning())
			}
			eng, err := engine.New(memory.New(), eopts...)
			if err != nil {
				t.Fatal(err)
			}
			b, err := New("invoices", tc.args)
			if tc.malformed != "" {
				if err == nil || !strings.Contains(err.Error(), tc.malformed) || !strings.Contains(err.Error(), `queue "invoices"`) {
					t.Errorf("New = %v; want an error that names the queue and says %q", err, tc.malformed)
				}
			} else if err != nil {
				t.Fatalf("New = %v", err)
			} else {
				c, err := consumer.New(eng, "billing", b, handler, opts...)
				var herr *consumer.HorizonError
				switch {
				case tc.unbounded || tc.bounded:
					if !errors.As(err, &herr) || herr.Horizon.Unbounded != tc.unbounded {
						t.Fatalf("consumer.New = %v; want a HorizonError, unbounded %v", err, tc.unbounded)
					}
					if !strings.Contains(err.Error(), "queue invoices") {
						t.Errorf("the error does not name the queue: %v", err)
					}
				case err != nil || c == nil:
					t.Fatalf("consumer.New = %v", err)
				}
			}
			if logged := strings.Contains(logs.String(), "WithHorizonWarning"); logged != (tc.warn && tc.malformed == "") {
				t.Errorf("horizon warning logged: %v; want %v", logged, tc.warn)
			}
		})
	}
}

func TestID(t *testing.T) {
	for _, tc := range []struct {
		name   string
		id     func(amqp.Delivery) (string, error)
		d      amqp.Delivery
		want   string
		noID   bool   // want consumer.ErrNoID
		errSay string // want another error, that says this
	}{
		{name: "message-id", id: MessageID, d: amqp.Delivery{MessageId: "m1"}, want: "m1"},
		{name: "no message-id", id: MessageID, d: amqp.Delivery{Headers: amqp.Table{"cloudEvents:id": "c1"}}, noID: true},
		{name: "cloudEvents:id", id: CloudEventsID, d: amqp.Delivery{MessageId: "m1", Headers: amqp.Table{"cloudEvents:id": "c1"}}, want: "c1"},
		{name: "cloudEvents_id", id: CloudEventsID, d: amqp.Delivery{Headers: amqp.Table{"cloudEvents_id": "c1"}}, want: "c1"},
		{name: "both, equal", id: CloudEventsID, d: amqp.Delivery{Headers: amqp.Table{"cloudEvents:id": "c1", "cloudEvents_id": "c1"}}, want: "c1"},
		{name: "both, different", id: CloudEventsID, d: amqp.Delivery{Headers: amqp.Table{"cloudEvents:id": "c1", "cloudEvents_id": "c2"}}, errSay: "differ"},
		{name: "not a string", id: CloudEventsID, d: amqp.Delivery{Headers: amqp.Table{"cloudEvents:id": int64(7)}}, errSay: "cloudEvents:id header is a int64"},
		{name: "no cloudEvents:id", id: CloudEventsID, d: amqp.Delivery{MessageId: "m1"}, noID: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.id(tc.d)
			switch {
			case tc.noID:
				if !errors.Is(err, consumer.ErrNoID) {
					t.Errorf("err = %v; want ErrNoID", err)
				}
			case tc.errSay != "":
				if err == nil || !strings.Contains(err.Error(), tc.errSay) || strings.Contains(err.Error(), "c1") {
					t.Errorf("err = %v; want one that says %q, without the id", err, tc.errSay)
				}
			case err != nil || got != tc.want:
				t.Errorf("id = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

// TestNoDeadLetter: consumer.New refuses a consumer of New's Broker with nowhere to put a dead
// letter, naming both ways out, unless the consumer says it discards them.
func TestNoDeadLetter(t *testing.T) {
	args := amqp.Table{"x-message-ttl": int64(time.Hour / time.Millisecond)}
	handler := func(context.Context, amqp.Delivery) error { return nil }
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	b, err := New("invoices", args)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.New(eng, "billing", b, handler); err == nil ||
		!strings.Contains(err.Error(), "WithDeadLetter") || !strings.Contains(err.Error(), "consumer.WithDiscardDeadLetters") {
		t.Fatalf("consumer.New without a dead-letter hook: %v, want an error naming WithDeadLetter and consumer.WithDiscardDeadLetters", err)
	}
	keep := consumer.WithDeadLetter(func(context.Context, amqp.Delivery, error) error { return nil })
	if _, err := consumer.New(eng, "billing", b, handler, keep); err != nil {
		t.Fatalf("consumer.New with a hook: %v", err)
	}
}
