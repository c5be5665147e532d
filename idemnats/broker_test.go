package idemnats

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
)

// fakeMsg is a delivery of a JetStream message, the NumDelivered-th, that
// records how it was settled.
type fakeMsg struct {
	jetstream.Msg // nil: a method not overridden here panics
	delivered     uint64
	settled       string
	delay         time.Duration
}

func (m *fakeMsg) Data() []byte { return []byte("charge") }
func (m *fakeMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: m.delivered, Timestamp: time.Unix(1e9, 0)}, nil
}
func (m *fakeMsg) Ack() error  { m.settled = "ack"; return nil }
func (m *fakeMsg) Term() error { m.settled = "term"; return nil }
func (m *fakeMsg) NakWithDelay(d time.Duration) error {
	m.settled, m.delay = "nak", d
	return nil
}

// TestCheckTenantIDs: a tenant function is refused with ids read from
// Nats-Msg-Id by MessageID (the default, nil), on a stream that drops
// duplicates of it or mirrors one; not with UniqueMessageID or another
// header's id.
func TestCheckTenantIDs(t *testing.T) {
	window := &broker{stream: jetstream.StreamConfig{Name: "PAYMENTS", Duplicates: 2 * time.Minute}, cons: jetstream.ConsumerConfig{Durable: "charges"}}
	mirror := &broker{stream: jetstream.StreamConfig{Name: "PAYMENTS_MIRROR", Mirror: &jetstream.StreamSource{Name: "PAYMENTS"}}, cons: jetstream.ConsumerConfig{Durable: "charges"}}
	none := &broker{stream: jetstream.StreamConfig{Name: "PAYMENTS"}, cons: jetstream.ConsumerConfig{Durable: "charges"}}
	for _, tc := range []struct {
		name    string
		b       *broker
		id      any
		refused bool
	}{
		{"default", window, nil, true},
		{"MessageID", window, MessageID, true},
		{"UniqueMessageID", window, UniqueMessageID, false},
		{"CloudEventsID", window, CloudEventsID, false},
		{"mirror", mirror, nil, true},
		{"no window", none, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.b.CheckTenantIDs(tc.id) // as consumer.WithMessageID keeps it
			var werr *DuplicateWindowError
			if tc.refused != errors.As(err, &werr) {
				t.Fatalf("CheckTenantIDs: %v, want refused %v", err, tc.refused)
			}
			if werr != nil && (werr.Consumer != "charges" || werr.Stream != tc.b.stream.Name || werr.Window != tc.b.stream.Duplicates) {
				t.Fatalf("error %+v", werr)
			}
		})
	}
}

// TestReadAndSettle: Read counts deliveries and marks the one at max
// deliver the last; Settle acknowledges, terminates, or negative-acknowledges
// with the Result's delay (a Result with no Action too: JetStream delivers
// it again).
func TestReadAndSettle(t *testing.T) {
	b := &broker{cons: jetstream.ConsumerConfig{MaxDeliver: 3}}
	unlimited := &broker{cons: jetstream.ConsumerConfig{MaxDeliver: -1}}
	for _, tc := range []struct {
		b         *broker
		delivered uint64
		last      bool
	}{{b, 1, false}, {b, 2, false}, {b, 3, true}, {unlimited, 1000, false}} {
		d, err := tc.b.Read(&fakeMsg{delivered: tc.delivered})
		if err != nil {
			t.Fatal(err)
		}
		if d.Attempt != int(tc.delivered) || d.Redelivered != (tc.delivered > 1) || d.Last != tc.last || string(d.Body) != "charge" || !d.Sent.Equal(time.Unix(1e9, 0)) {
			t.Errorf("delivery %d of max deliver %d: %+v", tc.delivered, tc.b.cons.MaxDeliver, d)
		}
	}

	msgs := []*fakeMsg{{}, {}, {}, {}}
	results := []consumer.Result{
		{Action: consumer.Ack},
		{Action: consumer.Reject},
		{Action: consumer.Nak, Delay: time.Second},
		{},
	}
	ms := make([]jetstream.Msg, len(msgs))
	for i, m := range msgs {
		ms[i] = m
	}
	if err := b.Settle(t.Context(), ms, results); err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"ack", "term", "nak", "nak"} {
		if msgs[i].settled != want || want == "nak" && msgs[i].delay != results[i].Delay {
			t.Errorf("message %d settled %q after %s, want %q after %s", i, msgs[i].settled, msgs[i].delay, want, results[i].Delay)
		}
	}
}
