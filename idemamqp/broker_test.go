package idemamqp

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
)

// TestRead: a delivery's attempt comes from a quorum queue's
// x-delivery-count (none on its first), and its last delivery from the
// x-delivery-limit New was given, 0 making the first the last; a classic
// queue's deliveries never tell either.
func TestRead(t *testing.T) {
	sent := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		args    amqp.Table
		d       amqp.Delivery
		attempt int
		last    bool
	}{
		{"classic, first", nil, amqp.Delivery{}, 0, false},
		{"classic, redelivered", nil, amqp.Delivery{Redelivered: true}, 0, false},
		{"quorum, first", amqp.Table{"x-delivery-limit": int64(2)}, amqp.Delivery{}, 1, false},
		{"quorum, limit 0", amqp.Table{"x-delivery-limit": int64(0)}, amqp.Delivery{}, 1, true},
		{"quorum, second", amqp.Table{"x-delivery-limit": int64(2)}, amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(1)}}, 2, false},
		{"quorum, last", amqp.Table{"x-delivery-limit": int64(2)}, amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(2)}}, 3, true},
		{"quorum, no limit given", amqp.Table{"x-queue-type": "quorum"}, amqp.Delivery{Redelivered: true, Headers: amqp.Table{"x-delivery-count": int64(30)}}, 31, false},
		{"negative count", amqp.Table{"x-delivery-limit": 2}, amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(-1)}}, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := New("q", tc.args)
			if err != nil {
				t.Fatal(err)
			}
			tc.d.Body, tc.d.Timestamp = []byte("body"), sent
			got, err := b.Read(tc.d)
			if err != nil {
				t.Fatal(err)
			}
			want := consumer.Delivery{Body: []byte("body"), Attempt: tc.attempt, Redelivered: tc.d.Redelivered, Last: tc.last, Sent: sent}
			if string(got.Body) != "body" || got.Attempt != want.Attempt || got.Redelivered != want.Redelivered || got.Last != want.Last || !got.Sent.Equal(sent) || got.ID != "" || got.Skip != nil {
				t.Errorf("Read = %+v; want %+v", got, want)
			}
		})
	}
}

// TestBusyDelay: Settle holds a message in progress elsewhere for at most
// busyDelay on a queue without a delivery limit, and for the Result's whole
// delay on one with a limit, whose deliveries it would spend; every other
// Result keeps its delay.
func TestBusyDelay(t *testing.T) {
	unlimited, _ := New("q", nil)
	limited, _ := New("q", amqp.Table{"x-delivery-limit": int64(5)})
	for _, tc := range []struct {
		name string
		b    any
		res  consumer.Result
		want time.Duration
	}{
		{"busy, no limit", unlimited, consumer.Result{Outcome: consumer.Busy, Action: consumer.Nak, Delay: time.Minute}, busyDelay},
		{"busy, no limit, shorter", unlimited, consumer.Result{Outcome: consumer.Busy, Action: consumer.Nak, Delay: 10 * time.Millisecond}, 10 * time.Millisecond},
		{"busy, limit", limited, consumer.Result{Outcome: consumer.Busy, Action: consumer.Nak, Delay: time.Minute}, time.Minute},
		{"retry, no limit", unlimited, consumer.Result{Outcome: consumer.Retry, Action: consumer.Nak, Delay: time.Minute}, time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.b.(*broker).delay(tc.res); got != tc.want {
				t.Errorf("delay = %v; want %v", got, tc.want)
			}
		})
	}
}
