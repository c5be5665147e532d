package idemkafka_test

import (
	"context"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/tests/brokertest"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// TestPublisherSuite runs the publisher suite on kfake, which creates no
// topic it is not asked to.
func TestPublisherSuite(t *testing.T) {
	brokertest.RunPublisher(t, brokertest.PublisherFeatures{}, newPublisherRig)
}

// publisherRig is a topic of three partitions of a cluster of its own,
// consumed by a group of its own; the Publisher's client has kgo's
// defaults (an idempotent producer, acks from all replicas).
type publisherRig struct {
	topic string
	pub   *idemkafka.Publisher
	cl    *kgo.Client
	b     consumer.Broker[*kgo.Record]
}

func newPublisherRig(t *testing.T) brokertest.PublisherRig[*kgo.Record] {
	brokers := kafkatest.Brokers(t)
	r := &publisherRig{topic: kafkatest.Topic(t, brokers, "charges", 3, nil)}
	var err error
	if r.pub, err = idemkafka.NewPublisher(kafkatest.Client(t, brokers)); err != nil {
		t.Fatal(err)
	}
	r.cl = kafkatest.GroupClient(t, brokers, kafkatest.Name("g"), []string{r.topic})
	if r.b, err = idemkafka.New(t.Context(), r.cl); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *publisherRig) Publisher() outbox.Publisher          { return r.pub }
func (r *publisherRig) Destination() string                  { return r.topic }
func (r *publisherRig) Refused() string                      { return kafkatest.Name("no-topic") }
func (r *publisherRig) Broker() consumer.Broker[*kgo.Record] { return r.b }

func (r *publisherRig) Headers(rec *kgo.Record) map[string]string {
	h := map[string]string{}
	for _, kv := range rec.Headers {
		h[kv.Key] = string(kv.Value)
	}
	return h
}

// Consume is consume's, on the rig's client.
func (r *publisherRig) Consume(ctx context.Context, _ *testing.T, handle func(*kgo.Record)) {
	consume(ctx, r.cl, handle)
}
