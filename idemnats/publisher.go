package idemnats

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/outbox"
)

// Publisher is an outbox.Publisher to JetStream: a Relay's messages, each
// published to its Destination as a subject, confirmed by a PubAck.
type Publisher struct {
	js jetstream.JetStream
}

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher to js, for outbox's Relay:
//
//	pub, err := idemnats.NewPublisher(js)
//	relay, err := ob.Relay(pub)
//	go relay.Run(ctx)
//
// A message's ID becomes its Nats-Msg-Id header, which JetStream's
// duplicate window drops a resend of, and which New's consumers read as the
// key by default; its Headers become NATS headers (a Nats-Msg-Id among them
// is replaced by the ID), its Payload the data, and its Destination the
// subject, which a stream must take. PartitionKey orders nothing on
// JetStream, which keeps a stream's order; the Relay sends a partition's
// messages one after another. A message no stream takes (no responders) is
// an error, and stays in the outbox.
//
// A batch is published asynchronously and each PubAck awaited, so that it
// takes about one round trip. Give js an ack timeout
// (jetstream.WithPublishAsyncTimeout) shorter than the Relay's lease, so
// that a lost PubAck's pending publish does not outlive Publish's wait.
func NewPublisher(js jetstream.JetStream) (*Publisher, error) {
	if js == nil {
		return nil, errors.New("idemnats: NewPublisher needs a JetStream, not nil")
	}
	return &Publisher{js: js}, nil
}

// Publish publishes ms and waits for the PubAck of each until ctx ends:
// nil if JetStream stored or, as a duplicate within its window, had
// already stored all, else errs[i] for ms[i].
func (p *Publisher) Publish(ctx context.Context, ms []outbox.Message) []error {
	errs := make([]error, len(ms))
	futures := make([]jetstream.PubAckFuture, len(ms))
	for i, m := range ms {
		msg := nats.NewMsg(m.Destination)
		msg.Data = m.Payload
		for k, v := range m.Headers {
			msg.Header.Set(k, v)
		}
		msg.Header.Set(jetstream.MsgIDHeader, m.ID)
		if futures[i], errs[i] = p.js.PublishMsgAsync(msg); errs[i] != nil {
			errs[i] = fmt.Errorf("idemnats: publishing to %s: %w", m.Destination, errs[i])
		}
	}
	failed := false
	for i, f := range futures {
		if f == nil {
			failed = true
			continue
		}
		select {
		case <-f.Ok(): // Duplicate or not, the stream holds it
		case err := <-f.Err():
			errs[i] = fmt.Errorf("idemnats: publishing to %s: %w", ms[i].Destination, err)
		case <-ctx.Done():
			errs[i] = fmt.Errorf("idemnats: waiting for the PubAck of a message to %s: %w", ms[i].Destination, ctx.Err())
		}
		failed = failed || errs[i] != nil
	}
	if !failed {
		return nil
	}
	return errs
}
