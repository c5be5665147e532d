package idemkafka

import (
	"context"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// The headers a dead letter written by WithDeadLetterTopic carries besides
// the record's own: why, and where the record was (named in its doc, not
// exported: a reader of the topic need not import this package).
const (
	headerError     = "idemkey-error"     // why: never the record's id, tenant or body
	headerTopic     = "idemkey-topic"     // the record's topic
	headerPartition = "idemkey-partition" // its partition, in decimal
	headerOffset    = "idemkey-offset"    // its offset, in decimal
)

// WithDeadLetterTopic sets a dead-letter hook (WithDeadLetter) that writes
// the record, its key, value and headers, to topic with the consumer's
// client, and waits until Kafka has it; the cause and where the record was
// are in the headers idemkey-error, idemkey-topic, idemkey-partition and
// idemkey-offset (decimal). idemkey-error names idemkey's reason, or the handler's gRPC
// code, or only its error's type: a handler's words may quote the record,
// and the dead letter is read by others. A write that fails leaves the
// record uncommitted, processed again.
func WithDeadLetterTopic(topic string) Option {
	return func(o *options) { o.deadLetterTopic = topic }
}

// writeDeadLetter writes r to the dead-letter topic, with why it failed.
func (c *Consumer) writeDeadLetter(ctx context.Context, r *kgo.Record, err error) error {
	headers := append(make([]kgo.RecordHeader, 0, len(r.Headers)+4), r.Headers...)
	headers = append(headers,
		kgo.RecordHeader{Key: headerError, Value: []byte(consumer.Cause(err))},
		kgo.RecordHeader{Key: headerTopic, Value: []byte(r.Topic)},
		kgo.RecordHeader{Key: headerPartition, Value: []byte(strconv.FormatInt(int64(r.Partition), 10))},
		kgo.RecordHeader{Key: headerOffset, Value: []byte(strconv.FormatInt(r.Offset, 10))},
	)
	dead := &kgo.Record{Topic: c.opts.deadLetterTopic, Key: r.Key, Value: r.Value, Headers: headers}
	if err := c.cl.ProduceSync(ctx, dead).FirstErr(); err != nil {
		return fmt.Errorf("idemkafka: writing a dead letter to topic %s: %w", c.opts.deadLetterTopic, err)
	}
	return nil
}
