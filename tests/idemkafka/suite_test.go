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
// retried in process, so only its last Result is reported.
func TestSuite(t *testing.T) {
	brokertest.Run(t, brokertest.Features{DeliveryLimit: true}, newSuiteRig)
}

// suiteRig is a topic of one partition of a cluster of its own, consumed
// by a group of its own.
type suiteRig struct {
	topic string
	prod  *kgo.Client
	cl    *kgo.Client
	c     *idemkafka.Consumer
}

func newSuiteRig(t *testing.T, cfg brokertest.Config) (brokertest.Rig, error) {
	brokers := kafkatest.Brokers(t)
	r := &suiteRig{topic: kafkatest.Topic(t, brokers, "charges", 1, nil), prod: kafkatest.Client(t, brokers)}
	r.cl = kafkatest.GroupClient(t, brokers, kafkatest.Name("g"), []string{r.topic})
	var opts []idemkafka.Option
	if cfg.DeadLetter != nil {
		opts = append(opts, idemkafka.WithDeadLetter(func(_ context.Context, _ *kgo.Record, err error) error { return cfg.DeadLetter(err) }))
	}
	if cfg.MaxDeliveries > 0 {
		opts = append(opts, idemkafka.WithMaxAttempts(cfg.MaxDeliveries))
	}
	var err error
	r.c, err = idemkafka.New(t.Context(), cfg.Core, r.cl, func(ctx context.Context, rec *kgo.Record) error {
		id, _ := idemkafka.MessageID(rec)
		return cfg.Handler(ctx, id)
	}, opts...)
	if err != nil {
		return nil, err
	}
	return r, nil
}

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

func (r *suiteRig) Consume(ctx context.Context, _ *testing.T, report func(consumer.Result)) {
	for {
		rs, err := r.c.NextBatch(ctx, 100, 0)
		if err != nil {
			return // ctx done
		}
		for _, rec := range rs {
			report(r.c.Handle(ctx, rec))
		}
		r.cl.AllowRebalance()
	}
}
