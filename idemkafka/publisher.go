package idemkafka

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/outbox"
)

// Publisher is an outbox.Publisher to Kafka: a Relay's messages, produced
// as records with kgo, each awaited until the brokers acknowledged it.
type Publisher struct {
	cl *kgo.Client
}

var _ outbox.Publisher = (*Publisher)(nil)

// messageIDHeader is the header MessageID reads.
const messageIDHeader = "message-id"

// NewPublisher returns a Publisher that produces with cl, for outbox's
// Relay:
//
//	pub, err := idemkafka.NewPublisher(cl) // kgo's defaults: idempotent, acks=all
//	relay, err := ob.Relay(pub)
//	go relay.Run(ctx)
//
// A message's Destination becomes the record's topic; its PartitionKey the
// record's key, so that a partition key's records go to one partition, in
// the order the Relay sends them; its ID the message-id header, which New's
// consumers read as the key by default (a message-id among its Headers is
// left out); its Headers the other headers; its Payload the value.
//
// Kafka drops no resend by id: a message the Relay sends again (its
// acknowledgement lost, its relay died before it marked the message sent)
// is a second record, which idemkey's consumers drop as a duplicate. Keep
// cl an idempotent producer (kgo's default; not kgo.DisableIdempotentWrite)
// with acks from all in-sync replicas (kgo's default), so that kgo's own
// retries neither duplicate nor reorder a partition's records, and a
// record acknowledged is not lost with a broker. A topic that does not
// exist, where the brokers do not create it, is an error for its messages
// once kgo's retries of it end (kgo.UnknownTopicRetries), and they stay in
// the outbox.
func NewPublisher(cl *kgo.Client) (*Publisher, error) {
	if cl == nil {
		return nil, errors.New("idemkafka: NewPublisher needs a client, not nil")
	}
	return &Publisher{cl: cl}, nil
}

// Publish produces ms and waits until each is acknowledged or has failed,
// or ctx ends: nil if all were acknowledged, else errs[i] for ms[i].
func (p *Publisher) Publish(ctx context.Context, ms []outbox.Message) []error {
	rs := make([]*kgo.Record, len(ms))
	index := make(map[*kgo.Record]int, len(ms)) // ProduceSync's results come as they end
	for i, m := range ms {
		r := &kgo.Record{Topic: m.Destination, Key: []byte(m.PartitionKey), Value: m.Payload,
			Headers: make([]kgo.RecordHeader, 0, len(m.Headers)+1)}
		for k, v := range m.Headers {
			if k != messageIDHeader {
				r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
			}
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: messageIDHeader, Value: []byte(m.ID)})
		rs[i], index[r] = r, i
	}
	results := p.cl.ProduceSync(ctx, rs...)
	var errs []error
	for _, res := range results {
		if res.Err == nil {
			continue
		}
		if errs == nil {
			errs = make([]error, len(ms))
		}
		i := index[res.Record]
		errs[i] = fmt.Errorf("idemkafka: producing to %s: %w", ms[i].Destination, res.Err)
	}
	return errs
}
