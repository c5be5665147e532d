package idemkafka

import (
	"context"

	"github.com/twmb/franz-go/pkg/kgo"
)

// defaultMaxAttempts is how many times a record that fails for now is
// processed before it is dead-lettered (WithMaxAttempts).
const defaultMaxAttempts = 5

// Option configures a Consumer.
type Option func(*options)

type options struct {
	id         func(*kgo.Record) (string, error)
	tenant     func(*kgo.Record) (string, error)
	deadLetter func(context.Context, *kgo.Record, error) error
	// deadLetterTopic, if set, is where New's own hook writes dead letters
	// (WithDeadLetterTopic).
	deadLetterTopic string
	maxAttempts     int
}

func newOptions(opts []Option) *options {
	o := &options{id: MessageID, maxAttempts: defaultMaxAttempts}
	for _, opt := range opts {
		opt(o)
	}
	return o
}

// WithMessageID sets how a record's id is read (MessageID by default); an
// error refuses the record. CloudEventsID reads a CloudEvent's; a function
// of the record's own, say its key, reads another.
func WithMessageID(f func(*kgo.Record) (string, error)) Option {
	return func(o *options) {
		if f != nil {
			o.id = f
		}
	}
}

// WithMessageTenant scopes message ids to the tenant f reads from a record,
// for example from a header its producer sets. An error refuses the record.
// Kafka drops no record for its id, so two tenants' records with one id are
// two messages.
func WithMessageTenant(f func(*kgo.Record) (string, error)) Option {
	return func(o *options) { o.tenant = f }
}

// WithDeadLetter sets a hook for records that failed for good, were
// refused, or failed for now on their last attempt, before their offsets
// are committed. err says why (consumer.Result.Err: the handler's error,
// whose words may quote the record). If the hook fails, the record is not
// committed: it is processed again, and handed to the hook again.
// WithDeadLetterTopic is a hook that writes the record to a topic. New
// refuses a consumer with neither unless its core was built with
// consumer.WithDiscardDeadLetters, which commits such records and keeps
// nothing.
func WithDeadLetter(f func(ctx context.Context, r *kgo.Record, err error) error) Option {
	return func(o *options) { o.deadLetter = f }
}

// WithMaxAttempts sets how many times a record that fails for now (the
// handler's transient error, the store failing, its id in progress
// elsewhere) is processed, each after the backoff of consumer.WithBackoff,
// before its last attempt dead-letters it (5 by default). Values
// below 1 keep the default.
func WithMaxAttempts(n int) Option {
	return func(o *options) {
		if n >= 1 {
			o.maxAttempts = n
		}
	}
}
