package idemamqp

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Option configures a Consumer.
type Option func(*options)

type options struct {
	id         func(amqp.Delivery) (string, error)
	tenant     func(amqp.Delivery) (string, error)
	deadLetter func(context.Context, amqp.Delivery, error) error
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
func WithMessageID(f func(amqp.Delivery) (string, error)) Option {
	return func(o *options) {
		if f != nil {
			o.id = f
		}
	}
}

// WithMessageTenant scopes message ids to the tenant f reads from a message, for
// example from a header its producer sets. An error refuses the message.
func WithMessageTenant(f func(amqp.Delivery) (string, error)) Option {
	return func(o *options) { o.tenant = f }
}

// WithDeadLetter sets a hook for messages that failed for good or were
// refused, for example to publish them to a dead-letter exchange of one's
// own, before they are acknowledged or rejected. err says why
// (consumer.Result.Err). If the hook fails, the message is redelivered, and
// handed to it again.
//
// New refuses a consumer without a hook unless its core was built with
// consumer.WithDiscardDeadLetters. Then a refused message is rejected
// without requeueing, which a queue declared with an x-dead-letter-exchange
// dead-letters; a message that failed for good is acknowledged, and kept
// by nothing. err's words may quote the message: consumer.Cause says why in
// idemkey's.
func WithDeadLetter(f func(ctx context.Context, d amqp.Delivery, err error) error) Option {
	return func(o *options) { o.deadLetter = f }
}
