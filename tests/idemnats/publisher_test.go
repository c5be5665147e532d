package idemnats_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/tests/brokertest"
	"github.com/idemkey/idemkey/tests/natstest"
)

// TestPublisherSuite runs the publisher suite on JetStream, whose
// duplicate window drops a resend.
func TestPublisherSuite(t *testing.T) {
	brokertest.RunPublisher(t, brokertest.PublisherFeatures{DropsDuplicates: true}, newPublisherRig)
}

// publisherRig is a stream with the default duplicate window (2 minutes),
// and a durable consumer of it.
type publisherRig struct {
	pub     *idemnats.Publisher
	subject string
	cons    jetstream.Consumer
	b       consumer.Broker[jetstream.Msg]
}

func newPublisherRig(t *testing.T) brokertest.PublisherRig[jetstream.Msg] {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	cons, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{
		Durable: natstest.Name("c"), AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	b, err := idemnats.New(t.Context(), stream, cons)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := idemnats.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	return &publisherRig{pub: pub, subject: stream.CachedInfo().Config.Name + ".charges", cons: cons, b: b}
}

func (r *publisherRig) Publisher() outbox.Publisher            { return r.pub }
func (r *publisherRig) Destination() string                    { return r.subject }
func (r *publisherRig) Refused() string                        { return natstest.Name("NOSTREAM") + ".charges" }
func (r *publisherRig) Broker() consumer.Broker[jetstream.Msg] { return r.b }
func (r *publisherRig) Headers(m jetstream.Msg) map[string]string {
	h := map[string]string{}
	for k := range m.Headers() {
		h[k] = m.Headers().Get(k)
	}
	return h
}

func (r *publisherRig) Consume(ctx context.Context, t *testing.T, handle func(jetstream.Msg)) {
	cc, err := r.cons.Consume(handle)
	if err != nil {
		t.Error(err)
		return
	}
	<-ctx.Done()
	cc.Stop()
	<-cc.Closed()
}
