package idemnats

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"
)

// Option configures a Consumer.
type Option func(*options)

type options struct {
	id         func(jetstream.Msg) (string, error)
	tenant     func(jetstream.Msg) (string, error)
	deadLetter func(context.Context, jetstream.Msg, error) error
}

func newOptions(opts []Option) *options {
	o := &options{id: MessageID}
	for _, opt := range opts {
		opt(o)
	}
	return o
}

// WithMessageID sets how a message's id is read (MessageID by default); an error
// refuses the message. CloudEventsID reads a CloudEvent's.
func WithMessageID(f func(jetstream.Msg) (string, error)) Option {
	return func(o *options) {
		if f != nil {
			o.id = f
		}
	}
}

// WithMessageTenant scopes message ids to the tenant f reads from a message, for
// example from a header its producer sets. An error refuses the message.
func WithMessageTenant(f func(jetstream.Msg) (string, error)) Option {
	return func(o *options) { o.tenant = f }
}

// WithDeadLetter sets a hook for messages that failed for good or were
// refused, for example to publish them to a dead-letter subject, before they
// are acknowledged or terminated. err says why (consumer.Result.Err). If the
// hook fails, the message is redelivered, and handed to it again.
func WithDeadLetter(f func(ctx context.Context, msg jetstream.Msg, err error) error) Option {
	return func(o *options) { o.deadLetter = f }
}
