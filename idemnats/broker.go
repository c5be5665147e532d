package idemnats

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
)

// New returns the Broker of cons, a consumer of stream, for consumer.New:
//
//	b, err := idemnats.New(ctx, stream, cons)
//	c, err := consumer.New(eng, "billing", b, handle, consumer.WithDeadLetter(keep))
//	cc, err := cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
//
// It reads both configurations, and refuses a consumer that does not
// acknowledge explicitly (AckExplicitPolicy). The Broker's horizon, which
// consumer.New checks against the retention, is the stream's max age and,
// while consumers run, max deliver times the longest wait between two
// deliveries; without either, for ever. With consumer.WithMessageTenant,
// consumer.New refuses the default MessageID (a *DuplicateWindowError):
// read ids with UniqueMessageID, or another header.
func New(ctx context.Context, stream jetstream.Stream, cons jetstream.Consumer) (consumer.Broker[jetstream.Msg], error) {
	si, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemnats: reading the stream's configuration: %w", err)
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemnats: reading the consumer's configuration: %w", err)
	}
	if ci.Config.AckPolicy != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("idemnats: consumer %q must acknowledge explicitly (AckExplicitPolicy), to be redelivered what it did not finish", ci.Name)
	}
	b := &broker{stream: si.Config, cons: ci.Config}
	b.cons.Durable = ci.Name // named in the horizon, ephemeral ones too
	return b, nil
}

// broker is a JetStream consumer's consumer.Broker.
type broker struct {
	stream jetstream.StreamConfig
	cons   jetstream.ConsumerConfig
}

func (*broker) System() string { return "nats" }

func (*broker) ID(msg jetstream.Msg) (string, error) { return MessageID(msg) }

func (b *broker) Read(msg jetstream.Msg) (consumer.Delivery, error) {
	meta, err := msg.Metadata()
	if err != nil {
		return consumer.Delivery{}, fmt.Errorf("idemnats: not a JetStream message: %w", err)
	}
	return consumer.Delivery{
		Body:        msg.Data(),
		Attempt:     int(min(meta.NumDelivered, 1<<20)),
		Redelivered: meta.NumDelivered > 1,
		Last:        b.cons.MaxDeliver > 0 && meta.NumDelivered >= uint64(b.cons.MaxDeliver),
		Sent:        meta.Timestamp, // when the stream stored it, on the server's clock
	}, nil
}

// Settle acknowledges each message as its Result says: Ack, Term, or
// NakWithDelay. JetStream redelivers a message whose acknowledgement was
// lost after its ack wait.
func (*broker) Settle(_ context.Context, msgs []jetstream.Msg, results []consumer.Result) error {
	var errs []error
	for i, msg := range msgs {
		var err error
		switch results[i].Action {
		case consumer.Ack:
			err = msg.Ack()
		case consumer.Reject:
			err = msg.Term() // TermWithReason needs nats-server 2.10.4
		default:
			err = msg.NakWithDelay(results[i].Delay)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (b *broker) Horizons(maxBackoff time.Duration) []consumer.Horizon {
	return []consumer.Horizon{redeliveryHorizon(b.stream, b.cons, maxBackoff)}
}

// CheckTenantIDs refuses a tenant function with ids read from the
// Nats-Msg-Id header (id is nil or MessageID), which JetStream deduplicates
// across tenants.
func (b *broker) CheckTenantIDs(id any) error {
	if id != nil && reflect.ValueOf(id).Pointer() != reflect.ValueOf(MessageID).Pointer() {
		return nil
	}
	if b.stream.Duplicates <= 0 && b.stream.Mirror == nil {
		return nil
	}
	return &DuplicateWindowError{Consumer: b.cons.Durable, Stream: b.stream.Name, Window: b.stream.Duplicates}
}

// DuplicateWindowError is consumer.New's refusal of a consumer that scopes
// message ids by tenant (consumer.WithMessageTenant) but reads them from the
// Nats-Msg-Id header (MessageID), on a stream that deduplicates that header: JetStream drops a
// message whose Nats-Msg-Id it stored within the stream's duplicate window,
// whichever the tenant, before any consumer sees it. A second tenant's
// message with a first one's id is acknowledged to its producer as a
// duplicate and never processed.
type DuplicateWindowError struct {
	Consumer string
	Stream   string
	// Window is the stream's duplicate window; 0 for a mirror, whose origin
	// stream dropped the messages within its own.
	Window time.Duration
}

func (e *DuplicateWindowError) Error() string {
	drops := fmt.Sprintf("stream %s drops a message whose Nats-Msg-Id it stored within its duplicate window (%s)", e.Stream, e.Window)
	if e.Window <= 0 {
		drops = fmt.Sprintf("stream %s mirrors a stream that drops a message whose Nats-Msg-Id it stored within its duplicate window", e.Stream)
	}
	return fmt.Sprintf("idemnats: consumer %q scopes message ids by tenant, but %s, whichever the tenant: "+
		"a tenant's message is lost when another's has its id. "+
		"Publish every Nats-Msg-Id unique across tenants, the tenant prefixed to the id (\"<tenant>/<id>\"), and read it with consumer.WithMessageID(idemnats.UniqueMessageID); "+
		"or read a tenant's own id from another header with consumer.WithMessageID, and publish no Nats-Msg-Id or one unique across tenants "+
		"(the window cannot be turned off: a Duplicates of 0 is JetStream's default, 2 minutes)",
		e.Consumer, drops)
}

// redeliveryHorizon is how long JetStream may redeliver a message of stream to cons:
// at most the stream's max age, after which the message is gone, and, while
// consumers run, at most max deliver times the longest wait between two
// deliveries (the ack wait or its back-off, or a negative acknowledgement's
// delay of up to maxBackoff). Unbounded when neither is set: a stream
// without a max age and a consumer with an unlimited max deliver.
func redeliveryHorizon(stream jetstream.StreamConfig, cons jetstream.ConsumerConfig, maxBackoff time.Duration) consumer.Horizon {
	h := consumer.Horizon{Unbounded: true}
	if stream.MaxAge > 0 {
		h = consumer.Horizon{Bound: stream.MaxAge, Source: fmt.Sprintf("stream %s: max age", stream.Name)}
	}
	if cons.MaxDeliver > 0 {
		wait := max(cons.AckWait, maxBackoff)
		for _, b := range cons.BackOff {
			wait = max(wait, b)
		}
		d := time.Duration(math.MaxInt64) // where the product would overflow
		if wait <= 0 || int64(cons.MaxDeliver) <= math.MaxInt64/int64(wait) {
			d = time.Duration(cons.MaxDeliver) * wait
		}
		if h.Unbounded || d < h.Bound {
			h = consumer.Horizon{Bound: d, Source: fmt.Sprintf("consumer %s: max deliver %d × %s between deliveries", cons.Durable, cons.MaxDeliver, wait)}
		}
	}
	if h.Unbounded {
		h.Source = fmt.Sprintf("stream %s has no max age, and consumer %s no max deliver", stream.Name, cons.Durable)
	}
	h.Fix = fmt.Sprintf("set stream %s's MaxAge to at most the retention (a max deliver bounds it too, but gives up on a message that keeps failing, into the dead-letter hook)", stream.Name)
	return h
}

// MessageID is the default id of a message: its Nats-Msg-Id header, which
// JetStream also deduplicates within the stream's duplicate window, across
// tenants (see New).
func MessageID(msg jetstream.Msg) (string, error) {
	return header(msg, jetstream.MsgIDHeader)
}

// UniqueMessageID is MessageID, read from producers that make every
// Nats-Msg-Id unique across tenants, with the tenant in it
// ("<tenant>/<id>"): JetStream's duplicate window then drops only a
// tenant's own resend, and consumer.New accepts consumer.WithMessageTenant
// with it. New cannot see the producers: with ids two tenants share, one
// tenant's message is dropped by JetStream when another's has its id.
func UniqueMessageID(msg jetstream.Msg) (string, error) {
	return header(msg, jetstream.MsgIDHeader)
}

// CloudEventsID is the id of a CloudEvent in NATS's binary content mode: its
// ce-id header (consumer.WithMessageID(idemnats.CloudEventsID)).
func CloudEventsID(msg jetstream.Msg) (string, error) {
	return header(msg, "ce-id")
}

// header returns the one value of header name, or an error that names the
// header, never its value.
func header(msg jetstream.Msg, name string) (string, error) {
	switch v := msg.Headers().Values(name); len(v) {
	case 0:
		return "", fmt.Errorf("%w: no %s header", consumer.ErrNoID, name)
	case 1:
		return v[0], nil
	default:
		return "", errors.New("idemnats: the message has " + name + " more than once")
	}
}
