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
	// globalIDs: the producers make every Nats-Msg-Id unique across tenants
	// (WithMessageIDsUniqueAcrossTenants).
	globalIDs bool
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
//
// JetStream does not scope them so: within the stream's duplicate window it
// drops a message whose Nats-Msg-Id it stored, whichever the tenant. So New
// refuses a tenant function with the default MessageID (a
// *DuplicateWindowError), unless the producers make every Nats-Msg-Id unique
// across tenants (WithMessageIDsUniqueAcrossTenants), or WithMessageID reads
// a tenant's own id from elsewhere.
func WithMessageTenant(f func(jetstream.Msg) (string, error)) Option {
	return func(o *options) { o.tenant = f }
}

// WithMessageIDsUniqueAcrossTenants says that the producers publish every
// Nats-Msg-Id unique across tenants, with the tenant in it, say
// ("<tenant>/<id>"): JetStream's duplicate window then drops only a tenant's
// own resend, and New accepts WithMessageTenant with the default MessageID.
// New cannot see the producers; with ids that two tenants may share, one
// tenant's message is dropped by JetStream, before any consumer, when another
// tenant's has its id.
func WithMessageIDsUniqueAcrossTenants() Option {
	return func(o *options) { o.globalIDs = true }
}

// WithDeadLetter sets a hook for messages that failed for good or were
// refused, for example to publish them to a dead-letter subject, before they
// are acknowledged or terminated. err says why (consumer.Result.Err). If the
// hook fails, the message is redelivered, and handed to it again. err's
// words may quote the message: consumer.Cause says why in idemkey's.
//
// New refuses a consumer without a hook unless its core was built with
// consumer.WithDiscardDeadLetters, which acknowledges or terminates such
// messages and keeps nothing.
func WithDeadLetter(f func(ctx context.Context, msg jetstream.Msg, err error) error) Option {
	return func(o *options) { o.deadLetter = f }
}
