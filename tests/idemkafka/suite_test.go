package idemkafka_test

import (
	"context"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/tests/brokertest"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// TestSuite runs the broker suite on kfake. A record that fails for now is
// tried again in process (the Broker's MaxAttempts), so only its last
// Result is reported.
func TestSuite(t *testing.T) {
	brokertest.Run(t, brokertest.Features{DeliveryLimit: true}, newSuiteRig)
}

// suiteRig is a topic of one partition of a cluster of its own, consumed
// by a group of its own.
type suiteRig struct {
	topic string
	prod  *kgo.Client
	cl    *kgo.Client
	b     consumer.Broker[*kgo.Record]
}

func newSuiteRig(t *testing.T, cfg brokertest.Config) brokertest.Rig[*kgo.Record] {
	brokers := kafkatest.Brokers(t)
	r := &suiteRig{topic: kafkatest.Topic(t, brokers, "charges", 1, nil), prod: kafkatest.Client(t, brokers)}
	r.cl = kafkatest.GroupClient(t, brokers, kafkatest.Name("g"), []string{r.topic})
	var opts []idemkafka.Option
	if cfg.MaxDeliveries > 0 {
		opts = append(opts, idemkafka.WithMaxAttempts(cfg.MaxDeliveries))
	}
	var err error
	if r.b, err = idemkafka.New(t.Context(), r.cl, opts...); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *suiteRig) Broker() consumer.Broker[*kgo.Record] { return r.b }

func (r *suiteRig) Publish(t *testing.T, id, body string) {
	t.Helper()
	rec := &kgo.Record{Topic: r.topic, Value: []byte(body)}
	if id != "" {
		rec.Headers = []kgo.RecordHeader{{Key: "message-id", Value: []byte(id)}}
	}
	if err := r.prod.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// Consume is consume's, on the rig's client.
func (r *suiteRig) Consume(ctx context.Context, _ *testing.T, handle func(*kgo.Record)) {
	consume(ctx, r.cl, handle)
}

// consume polls cl until ctx ends, and hands each record of a poll to
// handle, in each partition's order, before the rebalances the poll held
// are allowed.
func consume(ctx context.Context, cl *kgo.Client, handle func(*kgo.Record)) {
	for {
		rs, err := idemkafka.NextBatch(ctx, cl, 100, 0)
		if err != nil {
			return // ctx done
		}
		for _, rec := range rs {
			handle(rec)
		}
		cl.AllowRebalance()
	}
}
