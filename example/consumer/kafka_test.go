package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/tests/kafkatest"
)

// kafkaBroker is a Kafka cluster (kfake in this test's process, or
// IDEMKEY_TEST_KAFKA's), with a topic and a group of the test's own: the
// consumer processes are killed and restarted against it, never the
// broker.
type kafkaBroker struct {
	brokers      []string
	topic, group string
	prod         *kgo.Client

	mu   sync.Mutex
	errs []error
}

// newKafka makes a topic of kafkaPartitions partitions, kept MaxStreamAge,
// for the consumers' group.
func newKafka(t *testing.T) *kafkaBroker {
	t.Helper()
	brokers := kafkatest.Brokers(t)
	b := &kafkaBroker{brokers: brokers, group: kafkatest.Name("charges"),
		topic: kafkatest.Topic(t, brokers, "payments", kafkaPartitions, kafkatest.Retention(MaxStreamAge, kafkaSegment))}
	b.prod = kafkatest.Client(t, brokers)
	return b
}

// args: a dead consumer's partitions move to the others after a session
// timeout of 3s, not kgo's 45s, which keeps the tests short. A handler
// timeout of 5s bounds the lease of a killed run's record (a minute by
// default): its next delivery, busy until then, holds its partition and
// the poll while it waits, which must stay well within the group's
// rebalance timeout (kgo's minute), as idemkafka's doc says.
func (b *kafkaBroker) args(string) []string {
	return []string{"-kafka-brokers", strings.Join(b.brokers, ","), "-topic", b.topic, "-name", b.group,
		"-kafka-session-timeout", "3s", "-handler-timeout", "5s"}
}

func (b *kafkaBroker) publish(ctx context.Context, id, tenant string, body []byte) error {
	r := &kgo.Record{Topic: b.topic, Value: body}
	if id != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: "message-id", Value: []byte(id)})
	}
	if tenant != "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: "tenant", Value: []byte(tenant)})
	}
	b.prod.Produce(ctx, r, func(_ *kgo.Record, err error) {
		if err != nil {
			b.mu.Lock()
			b.errs = append(b.errs, err)
			b.mu.Unlock()
		}
	})
	return nil
}

func (b *kafkaBroker) flush(ctx context.Context) error {
	if err := b.prod.Flush(ctx); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.errs) > 0 {
		return fmt.Errorf("%d records not produced: %v", len(b.errs), b.errs[0])
	}
	return nil
}

// ready counts the records the group has not committed.
func (b *kafkaBroker) ready(t *testing.T) int {
	t.Helper()
	return int(kafkatest.Lag(t, b.brokers, b.group, b.topic))
}

// settled waits until the group has committed every record, then stops
// procs.
func (b *kafkaBroker) settled(t *testing.T, procs ...*proc) {
	t.Helper()
	// Two minutes: a record whose run was killed, in two-phase mode, waits
	// for its lease (a minute) to end.
	waitFor(t, 2*time.Minute, "the group has committed every record", func() bool { return b.ready(t) == 0 })
	for _, p := range procs {
		p.stop(t)
	}
}
