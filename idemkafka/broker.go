package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// broker is a consumer group's consumer.Broker.
type broker struct {
	cl          *kgo.Client
	horizons    []consumer.Horizon
	maxAttempts int

	mu sync.Mutex
	// rewound holds, for each partition set back to a record that was not
	// settled (a Nak), the offset it was set back to, and for each partition
	// whose commit the group refused, the offset of its first record
	// refused: the records after it that a poll returned are skipped until
	// it comes again, or until the group's generation changes (a partition
	// assigned anew is fetched from its committed offset).
	rewound map[topicPartition]rewind
}

type topicPartition struct {
	topic     string
	partition int32
}

// rewind is where a partition was set back to, in which generation.
type rewind struct {
	offset     int64
	generation int32
}

// setBack records that tp's records after offset are to be skipped in the
// group's current generation. b.mu must be held.
func (b *broker) setBack(tp topicPartition, offset int64) {
	_, gen := b.cl.GroupMetadata()
	if at, ok := b.rewound[tp]; ok && at.generation == gen && at.offset <= offset {
		return
	}
	b.rewound[tp] = rewind{offset: offset, generation: gen}
}

// ErrRewound is the Err of a record passed over unrun: an earlier record of
// its partition was not settled, so its partition was set back to that
// record, and this one comes again after it; or the commit of an earlier
// one was refused because this member had left the group's generation (its
// rebalance timeout passed), and the partition is another member's.
var ErrRewound = errors.New("idemkafka: an earlier record of the partition was not settled, or not committed; the record is fetched again after it")

// New returns the Broker of the records cl polls, for consumer.New:
//
//	b, err := idemkafka.New(ctx, cl)
//	c, err := consumer.New(eng, "billing", b, handle, consumer.WithDeadLetter(idemkafka.DeadLetterTopic(cl, "billing.dead")))
//	for {
//		rs, err := idemkafka.NextBatch(ctx, cl, 32, 5*time.Millisecond)
//		if err != nil { break }
//		c.HandleBatch(ctx, rs)
//		cl.AllowRebalance()
//	}
//
// cl must consume a group (kgo.ConsumerGroup) of named topics
// (kgo.ConsumeTopics), commit only what it is told to
// (kgo.DisableAutoCommit), and hold rebalances while a poll's records are
// processed (kgo.BlockRebalanceOnPoll): New refuses another client. It
// reads each topic's retention.ms, segment.ms and cleanup.policy (with
// kadm): the Broker's horizon, which consumer.New checks against the
// retention, is how long Kafka still holds a record a group may read again.
//
// Kafka cannot deliver one record again: a record that fails for now is
// tried again in process, after each backoff, up to WithMaxAttempts times,
// the last of which dead-letters it.
func New(ctx context.Context, cl *kgo.Client, opts ...Option) (consumer.Broker[*kgo.Record], error) {
	if cl == nil {
		return nil, errors.New("idemkafka: New needs a client")
	}
	topics, err := checkClient(cl)
	if err != nil {
		return nil, err
	}
	horizons, err := readHorizons(ctx, cl, topics)
	if err != nil {
		return nil, err
	}
	b := &broker{cl: cl, horizons: horizons, maxAttempts: defaultMaxAttempts, rewound: map[topicPartition]rewind{}}
	for _, opt := range opts {
		opt(b)
	}
	return b, nil
}

func (*broker) System() string { return "kafka" }

func (*broker) ID(r *kgo.Record) (string, error) { return MessageID(r) }

func (b *broker) Horizons(time.Duration) []consumer.Horizon { return b.horizons }

// MaxAttempts is WithMaxAttempts': the consumer tries a record again in
// process (see consumer.Broker).
func (b *broker) MaxAttempts() int { return b.maxAttempts }

// Read reads r; the consumer counts its attempts. A record after one its
// partition was set back to is skipped (ErrRewound).
func (b *broker) Read(r *kgo.Record) (consumer.Delivery, error) {
	if b.skipped(r) {
		return consumer.Delivery{Skip: ErrRewound}, nil
	}
	return consumer.Delivery{Body: r.Value, Sent: r.Timestamp}, nil // the producer's time, or the broker's with LogAppendTime
}

// checkClient returns the topics cl consumes, or an error naming the
// option that cl lacks for records to be committed only once processed.
func checkClient(cl *kgo.Client) ([]string, error) {
	if group, _ := cl.OptValue(kgo.ConsumerGroup).(string); group == "" {
		return nil, errors.New("idemkafka: the client must consume in a group (kgo.ConsumerGroup), whose committed offsets say what was processed")
	}
	if manual, _ := cl.OptValue(kgo.DisableAutoCommit).(bool); !manual {
		return nil, errors.New("idemkafka: the client must not autocommit (kgo.DisableAutoCommit): it would commit the offsets of records before they are processed")
	}
	if blocks, _ := cl.OptValue(kgo.BlockRebalanceOnPoll).(bool); !blocks {
		return nil, errors.New("idemkafka: the client must hold rebalances during a poll (kgo.BlockRebalanceOnPoll, then cl.AllowRebalance once the poll's records are settled): " +
			"a partition revoked mid-poll would have its records processed by two members")
	}
	if regex, _ := cl.OptValue(kgo.ConsumeRegex).(bool); regex {
		return nil, errors.New("idemkafka: the client consumes topics by regular expression (kgo.ConsumeRegex): name them (kgo.ConsumeTopics), so that New can read each one's retention")
	}
	topics, _ := cl.OptValue(kgo.ConsumeTopics).([]string)
	if len(topics) == 0 {
		return nil, errors.New("idemkafka: the client consumes no topic (kgo.ConsumeTopics)")
	}
	return topics, nil
}

// skipped says whether r comes after the record its partition was set back
// to; a record at or before that offset is the partition fetched again.
func (b *broker) skipped(r *kgo.Record) bool {
	tp := topicPartition{r.Topic, r.Partition}
	b.mu.Lock()
	defer b.mu.Unlock()
	at, ok := b.rewound[tp]
	if !ok {
		return false
	}
	if _, gen := b.cl.GroupMetadata(); r.Offset > at.offset && gen == at.generation {
		return true
	}
	delete(b.rewound, tp)
	return false
}

// MessageID is the default id of a record: its message-id header, which the
// producer sets to the message's id, the same on every resend.
func MessageID(r *kgo.Record) (string, error) { return header(r, "message-id") }

// CloudEventsID is the id of a CloudEvent in Kafka's binary content mode:
// its ce_id header (consumer.WithMessageID(idemkafka.CloudEventsID)).
func CloudEventsID(r *kgo.Record) (string, error) { return header(r, "ce_id") }

// header returns the one value of header name, or an error that names the
// header, never its value.
func header(r *kgo.Record, name string) (string, error) {
	var v string
	n := 0
	for _, h := range r.Headers {
		if h.Key == name {
			v = string(h.Value)
			n++
		}
	}
	switch n {
	case 0:
		return "", fmt.Errorf("%w: no %s header", consumer.ErrNoID, name)
	case 1:
		return v, nil
	default:
		return "", errors.New("idemkafka: the record has the " + name + " header more than once")
	}
}
