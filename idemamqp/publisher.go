package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/outbox"
)

// Publisher is an outbox.Publisher to RabbitMQ: a Relay's messages,
// published on a channel of its own in confirm mode, each confirmed by the
// broker. It is safe for concurrent use; its Publishes take turns.
type Publisher struct {
	conn     *amqp.Connection
	exchange string

	mu      sync.Mutex
	ch      *amqp.Channel    // nil until opened, and after a failure
	returns chan amqp.Return // ch's unroutable messages
	closed  bool
}

var _ outbox.Publisher = (*Publisher)(nil)

// PublisherOption configures a Publisher.
type PublisherOption func(*publisherOptions)

type publisherOptions struct {
	exchange string
}

// WithExchange publishes to exchange, with each message's Destination as
// its routing key. The default, "", is RabbitMQ's default exchange, which
// routes a message to the queue its routing key names.
func WithExchange(name string) PublisherOption {
	return func(o *publisherOptions) { o.exchange = name }
}

// NewPublisher returns a Publisher on conn, for outbox's Relay:
//
//	pub, err := idemamqp.NewPublisher(conn) // to the queue each Destination names
//	defer pub.Close()
//	relay, err := ob.Relay(pub)
//	go relay.Run(ctx)
//
// A message's ID becomes its message-id property, which New's consumers
// read as the key by default; its Destination the routing key on the
// exchange (WithExchange; by default a queue's name); its Headers the AMQP
// headers; its Payload the body, delivered persistent. PartitionKey orders
// nothing on RabbitMQ, which keeps a queue's order; the Relay sends a
// partition's messages one after another. A message is mandatory: one that
// no queue takes is returned by the broker, and is an error that leaves it
// in the outbox, as is one the broker refuses (a negative confirmation).
//
// It opens its channel, in confirm mode, on the first Publish, and opens
// another on the next one after the channel closed (a channel error, the
// connection recovered); a closed conn it cannot reopen: each Publish then
// fails until the application gives the Relay a Publisher on a new one.
func NewPublisher(conn *amqp.Connection, opts ...PublisherOption) (*Publisher, error) {
	if conn == nil {
		return nil, errors.New("idemamqp: NewPublisher needs a connection, not nil")
	}
	var o publisherOptions
	for _, opt := range opts {
		opt(&o)
	}
	return &Publisher{conn: conn, exchange: o.exchange}, nil
}

// Close closes the Publisher's channel, once a Publish in progress has
// returned; a Publish after it fails. It leaves the connection open.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return p.drop()
}

// drop closes p's channel, if open, so that the next Publish opens
// another: what it had in flight (late confirmations, returns) is dropped
// with it. p.mu must be held.
func (p *Publisher) drop() error {
	if p.ch == nil {
		return nil
	}
	err := p.ch.Close()
	p.ch, p.returns = nil, nil
	if errors.Is(err, amqp.ErrClosed) {
		err = nil
	}
	return err
}

// channel returns p's channel, opening one in confirm mode if it has none
// or it closed. p.mu must be held.
func (p *Publisher) channel() (*amqp.Channel, error) {
	if p.closed {
		return nil, errors.New("idemamqp: the Publisher is closed")
	}
	if p.ch != nil && !p.ch.IsClosed() {
		return p.ch, nil
	}
	p.drop()
	ch, err := p.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("idemamqp: opening a channel to publish on: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return nil, fmt.Errorf("idemamqp: putting the channel in confirm mode: %w", err)
	}
	// The broker returns an unroutable message before it confirms it, and
	// the client hands the return over before the confirmation: Publish
	// reads returns while it waits, so that it has all of a message's once
	// the message is confirmed. The buffer spares the client's reader a
	// wait while Publish is still sending.
	p.returns = ch.NotifyReturn(make(chan amqp.Return, 128))
	p.ch = ch
	return ch, nil
}

// Publish publishes ms, each mandatory and persistent, and waits until the
// broker confirmed or refused each, or ctx ends: nil if it confirmed all
// and returned none, else errs[i] for ms[i].
func (p *Publisher) Publish(ctx context.Context, ms []outbox.Message) []error {
	if len(ms) == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(ms))
	ch, err := p.channel()
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	returned := map[string]amqp.Return{}
	readReturn := func(r amqp.Return, ok bool) {
		if !ok {
			p.returns = nil // the channel closed: its confirmations end as nacks
			return
		}
		returned[r.MessageId] = r
	}
	confs := make([]*amqp.DeferredConfirmation, len(ms))
	for i, m := range ms {
		msg := amqp.Publishing{
			MessageId:    m.ID,
			DeliveryMode: amqp.Persistent,
			Body:         m.Payload,
		}
		if len(m.Headers) > 0 {
			msg.Headers = make(amqp.Table, len(m.Headers))
			for k, v := range m.Headers {
				msg.Headers[k] = v
			}
		}
		confs[i], errs[i] = ch.PublishWithDeferredConfirmWithContext(ctx, p.exchange, m.Destination, true, false, msg)
		if errs[i] != nil {
			errs[i] = fmt.Errorf("idemamqp: publishing to %s: %w", m.Destination, errs[i])
		}
		select {
		case r, ok := <-p.returns:
			readReturn(r, ok)
		default:
		}
	}
	failed, abandoned := false, false
	for i, conf := range confs {
		for conf != nil && errs[i] == nil {
			select {
			case r, ok := <-p.returns:
				readReturn(r, ok)
				continue
			case <-conf.Done():
			case <-ctx.Done():
				errs[i] = fmt.Errorf("idemamqp: waiting for the confirmation of a message to %s: %w", ms[i].Destination, ctx.Err())
				abandoned = true
			}
			break
		}
		failed = failed || errs[i] != nil
	}
	// Every return came before its message's confirmation: those of ms are
	// read, or in the buffer.
	for drained := false; !drained && p.returns != nil; {
		select {
		case r, ok := <-p.returns:
			readReturn(r, ok)
		default:
			drained = true
		}
	}
	for i, conf := range confs {
		if errs[i] != nil || conf == nil {
			continue
		}
		if r, ok := returned[ms[i].ID]; ok {
			errs[i] = fmt.Errorf("idemamqp: the broker returned a message to %s as unroutable: %d %s", ms[i].Destination, r.ReplyCode, r.ReplyText)
		} else if !conf.Acked() {
			errs[i] = fmt.Errorf("idemamqp: the broker did not confirm a message to %s (a negative confirmation, or the channel closed)", ms[i].Destination)
		}
		failed = failed || errs[i] != nil
	}
	if abandoned {
		// Its late confirmations and returns would meet the next batch.
		p.drop()
	}
	if !failed {
		return nil
	}
	return errs
}
