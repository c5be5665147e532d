package idemkafka

import (
	"context"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// The headers a dead letter written by DeadLetterTopic carries besides
// the record's own: why, and where the record was (named in its doc, not
// exported: a reader of the topic need not import this package).
const (
	headerError     = "idemkey-error"     // why: never the record's id, tenant or body
	headerTopic     = "idemkey-topic"     // the record's topic
	headerPartition = "idemkey-partition" // its partition, in decimal
	headerOffset    = "idemkey-offset"    // its offset, in decimal
)

// DeadLetterTopic is a dead-letter hook, for consumer.WithDeadLetter, that
// writes the record, its key, value and headers, to topic with cl, and waits
// until Kafka has it. The headers idemkey-error, idemkey-topic,
// idemkey-partition and idemkey-offset (decimal) say why and where the
// record was; idemkey-error is consumer.Cause's, never the handler's words,
// which may quote the record. A write that fails leaves the record
// uncommitted, processed again.
func DeadLetterTopic(cl *kgo.Client, topic string) func(ctx context.Context, r *kgo.Record, err error) error {
	return func(ctx context.Context, r *kgo.Record, err error) error {
		return writeDeadLetter(ctx, cl, topic, r, err)
	}
}

// writeDeadLetter writes r to topic, with why it failed.
func writeDeadLetter(ctx context.Context, cl *kgo.Client, topic string, r *kgo.Record, err error) error {
	headers := append(make([]kgo.RecordHeader, 0, len(r.Headers)+4), r.Headers...)
	headers = append(headers,
		kgo.RecordHeader{Key: headerError, Value: []byte(consumer.Cause(err))},
		kgo.RecordHeader{Key: headerTopic, Value: []byte(r.Topic)},
		kgo.RecordHeader{Key: headerPartition, Value: []byte(strconv.FormatInt(int64(r.Partition), 10))},
		kgo.RecordHeader{Key: headerOffset, Value: []byte(strconv.FormatInt(r.Offset, 10))},
	)
	dead := &kgo.Record{Topic: topic, Key: r.Key, Value: r.Value, Headers: headers}
	if err := cl.ProduceSync(ctx, dead).FirstErr(); err != nil {
		return fmt.Errorf("idemkafka: writing a dead letter to topic %s: %w", topic, err)
	}
	return nil
}
