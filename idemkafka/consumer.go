package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// Handler processes one record. In atomic mode ctx carries the store's
// transaction (see consumer.WithAtomic); its error decides what becomes of
// the record (consumer.Handler).
type Handler func(ctx context.Context, r *kgo.Record) error

// Consumer processes the records a consumer group's client polls with a
// Handler, once per message id (see consumer.Consumer), and commits each
// record's offset once its outcome is durable.
type Consumer struct {
	core *consumer.Consumer
	cl   *kgo.Client
	h    Handler
	opts *options

	mu sync.Mutex
	// rewound holds, for each partition set back to a record that was not
	// settled (Settle of a Nak), the offset it was set back to, and for each
	// partition whose commit the group refused, the offset of its first
	// record refused: the records after it that a poll returned are skipped
	// until it comes again, or until the group's generation changes (a
	// partition assigned anew is fetched from its committed offset, which no
	// commit passed an unsettled record to).
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
// group's current generation. c.mu must be held.
func (c *Consumer) setBack(tp topicPartition, offset int64) {
	_, gen := c.cl.GroupMetadata()
	if at, ok := c.rewound[tp]; ok && at.generation == gen && at.offset <= offset {
		return
	}
	c.rewound[tp] = rewind{offset: offset, generation: gen}
}

// ErrRewound is the Err of a record that Process skipped without running:
// an earlier record of its partition was not settled, so its partition was
// set back to that record (Settle), and this one comes again after it; or
// the commit of an earlier one was refused because this member had left
// the group's generation (its rebalance timeout passed), and the partition
// is another member's.
var ErrRewound = errors.New("idemkafka: an earlier record of the partition was not settled, or not committed; the record is fetched again after it")

// New returns a Consumer that runs h for the records cl polls, with the
// idempotency of core. cl must consume a group (kgo.ConsumerGroup) of named
// topics (kgo.ConsumeTopics, not kgo.ConsumeRegex), commit only what it is
// told to (kgo.DisableAutoCommit), and hold rebalances while a poll's
// records are processed (kgo.BlockRebalanceOnPoll; call cl.AllowRebalance
// after each poll's records are settled): New refuses another client.
//
// It reads each topic's retention.ms, segment.ms and cleanup.policy (with
// kadm) and refuses (a *consumer.HorizonError) when core's records would
// expire while Kafka still holds a record that a group may read again,
// unless core was built with consumer.WithHorizonWarning.
//
// It starts nothing: poll with cl.PollRecords (or NextBatch), pass each
// record to Handle, or a poll's records to HandleBatch, then call
// cl.AllowRebalance.
func New(ctx context.Context, core *consumer.Consumer, cl *kgo.Client, h Handler, opts ...Option) (*Consumer, error) {
	if core == nil || cl == nil || h == nil {
		return nil, errors.New("idemkafka: New needs a consumer core, a client and a handler")
	}
	topics, err := checkClient(cl)
	if err != nil {
		return nil, err
	}
	horizons, err := readHorizons(ctx, cl, topics)
	if err != nil {
		return nil, err
	}
	for _, horizon := range horizons {
		if err := core.CheckHorizon(ctx, horizon); err != nil {
			return nil, err
		}
	}
	c := &Consumer{core: core, cl: cl, h: h, opts: newOptions(opts), rewound: map[topicPartition]rewind{}}
	if c.opts.deadLetterTopic != "" {
		c.opts.deadLetter = c.writeDeadLetter
	}
	if c.opts.deadLetter == nil && !core.DiscardsDeadLetters() {
		return nil, errNoDeadLetter
	}
	return c, nil
}

// errNoDeadLetter is New's answer to a consumer with nowhere to put a
// dead letter.
var errNoDeadLetter = errors.New("idemkafka: a record that fails for good, is refused, or fails for now on its last attempt has nowhere to go: " +
	"give WithDeadLetterTopic a topic, or WithDeadLetter a hook, that keeps it, " +
	"or build the consumer with consumer.WithDiscardDeadLetters() to commit such records and lose them, logged at Error level")

// deadLetter is the dead-letter hook for r; nil without one.
func (c *Consumer) deadLetter(r *kgo.Record) func(context.Context, error) error {
	if c.opts.deadLetter == nil {
		return nil
	}
	return func(ctx context.Context, err error) error { return c.opts.deadLetter(ctx, r, err) }
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

// Handle processes r and commits its offset as its outcome says: Process,
// then Settle. It returns the outcome, for a log line or a count.
func (c *Consumer) Handle(ctx context.Context, r *kgo.Record) consumer.Result {
	res := c.Process(ctx, r)
	c.Settle(ctx, r, res)
	return res
}

// Process decides what becomes of r, running the handler unless its id was
// processed before, without committing its offset: Settle does. Kafka
// cannot redeliver one record, so a record that fails for now (the
// consumer.Result's Action is Nak) is processed again here after its delay,
// up to WithMaxAttempts times; on the last attempt it is dead-lettered
// instead. A record refused, or failed for good, goes to the dead-letter
// hook; if the hook fails, the record is processed again too. Its Action is
// Nak on return only if ctx ended first, or the last attempt's dead letter
// failed: Settle then sets its partition back to it.
func (c *Consumer) Process(ctx context.Context, r *kgo.Record) consumer.Result {
	return c.ProcessBatch(ctx, []*kgo.Record{r})[0]
}

// Settle commits r's offset when res settles it (Ack, or Reject: Kafka has
// nothing to reject, and the dead-letter hook has had the record), so that
// the group does not deliver it again. When res would have it delivered
// again (Nak: ctx ended before its retries did), Settle sets r's partition
// back to r (cl.SetOffsets), so that it is fetched again, and the records
// after it are skipped until then: no offset past it is committed.
//
// A commit that fails (the partition was revoked meanwhile: the group's
// coordinator refuses a commit from a member of an earlier generation) is
// logged; the record is delivered again, to whichever member has its
// partition, and dropped as a duplicate. Once the group has refused a
// commit for that reason, the partition's later records in hand are
// skipped (ErrRewound) until the member is in a new generation.
func (c *Consumer) Settle(ctx context.Context, r *kgo.Record, res consumer.Result) {
	c.SettleBatch(ctx, []*kgo.Record{r}, []consumer.Result{res})
}

// delivery reads the attempt-th delivery of r into a Delivery; an error
// refuses it.
func (c *Consumer) delivery(r *kgo.Record, attempt int) (consumer.Delivery, error) {
	id, err := c.opts.id(r)
	if err != nil {
		return consumer.Delivery{}, err
	}
	var tenant string
	if c.opts.tenant != nil {
		if tenant, err = c.opts.tenant(r); err != nil {
			return consumer.Delivery{}, err
		}
	}
	return consumer.Delivery{
		ID:          id,
		Tenant:      tenant,
		Body:        r.Value,
		Attempt:     attempt,
		Redelivered: attempt > 1,
		Last:        attempt >= c.opts.maxAttempts,
		Sent:        r.Timestamp, // the producer's, or the broker's with LogAppendTime
	}, nil
}

// skipped says whether r comes after the record its partition was set back
// to; a record at or before that offset is the partition fetched again.
func (c *Consumer) skipped(r *kgo.Record) bool {
	tp := topicPartition{r.Topic, r.Partition}
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.rewound[tp]
	if !ok {
		return false
	}
	if _, gen := c.cl.GroupMetadata(); r.Offset > at.offset && gen == at.generation {
		return true
	}
	delete(c.rewound, tp)
	return false
}

// MessageID is the default id of a record: its message-id header, which the
// producer sets to the message's id, the same on every resend.
func MessageID(r *kgo.Record) (string, error) { return header(r, "message-id") }

// CloudEventsID is the id of a CloudEvent in Kafka's binary content mode:
// its ce_id header (WithMessageID(CloudEventsID)).
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
