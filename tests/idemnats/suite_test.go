package idemnats_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/tests/brokertest"
	"github.com/idemkey/idemkey/tests/natstest"
)

// TestSuite runs the broker suite on JetStream.
func TestSuite(t *testing.T) {
	brokertest.Run(t, brokertest.Features{DeliveryLimit: true}, newSuiteRig)
}

// suiteRig is a stream with a duplicate window of 100ms, and a durable
// consumer of it, whose ack wait is a second.
type suiteRig struct {
	js      jetstream.JetStream
	subject string
	cons    jetstream.Consumer
	b       consumer.Broker[jetstream.Msg]
}

func newSuiteRig(t *testing.T, cfg brokertest.Config) brokertest.Rig[jetstream.Msg] {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{Duplicates: 100 * time.Millisecond})
	maxDeliver := 20 // bounds the redelivery horizon
	if cfg.MaxDeliveries > 0 {
		maxDeliver = cfg.MaxDeliveries
	}
	cons, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{
		Durable: natstest.Name("c"), AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: maxDeliver,
	})
	if err != nil {
		t.Fatal(err)
	}
	b, err := idemnats.New(t.Context(), stream, cons)
	if err != nil {
		t.Fatal(err)
	}
	return &suiteRig{js: js, subject: stream.CachedInfo().Config.Name + ".charges", cons: cons, b: b}
}

func (r *suiteRig) Broker() consumer.Broker[jetstream.Msg] { return r.b }

func (r *suiteRig) Publish(t *testing.T, id, body string) {
	t.Helper()
	msg := nats.NewMsg(r.subject)
	msg.Data = []byte(body)
	if id != "" {
		msg.Header.Set(jetstream.MsgIDHeader, id)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ack, err := r.js.PublishMsg(t.Context(), msg)
		if err != nil {
			t.Fatal(err)
		}
		if !ack.Duplicate { // a resend within the window is dropped: send it again
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("JetStream kept the message for a duplicate past its window")
		}
	}
}

func (r *suiteRig) Consume(ctx context.Context, t *testing.T, handle func(jetstream.Msg)) {
	cc, err := r.cons.Consume(handle)
	if err != nil {
		t.Error(err)
		return
	}
	<-ctx.Done()
	cc.Stop()
	<-cc.Closed()
}
