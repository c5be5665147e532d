package idemamqp_test

import (
	"context"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/brokertest"
)

// TestPublisherSuite runs the publisher suite on RabbitMQ, to a quorum
// queue through the default exchange.
func TestPublisherSuite(t *testing.T) {
	brokertest.RunPublisher(t, brokertest.PublisherFeatures{}, newPublisherRig)
}

// publisherRig is a quorum queue of its own, which the Publisher reaches
// by its name on the default exchange.
type publisherRig struct {
	conn  *amqp.Connection
	pub   *idemamqp.Publisher
	queue string
	b     consumer.Broker[amqp.Delivery]
}

func newPublisherRig(t *testing.T) brokertest.PublisherRig[amqp.Delivery] {
	args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": ttl}
	conn := amqptest.Conn(t)
	queue := amqptest.Queue(t, conn, args)
	b, err := idemamqp.New(queue, args)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := idemamqp.NewPublisher(amqptest.Conn(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return &publisherRig{conn: conn, pub: pub, queue: queue, b: b}
}

func (r *publisherRig) Publisher() outbox.Publisher            { return r.pub }
func (r *publisherRig) Destination() string                    { return r.queue }
func (r *publisherRig) Refused() string                        { return amqptest.Name("no-queue") }
func (r *publisherRig) Broker() consumer.Broker[amqp.Delivery] { return r.b }

func (r *publisherRig) Headers(d amqp.Delivery) map[string]string {
	h := map[string]string{}
	for k, v := range d.Headers {
		h[k] = fmt.Sprint(v)
	}
	return h
}

func (r *publisherRig) Consume(ctx context.Context, t *testing.T, handle func(amqp.Delivery)) {
	ch, err := r.conn.Channel()
	if err != nil {
		t.Error(err)
		return
	}
	defer ch.Close()
	if err := ch.Qos(1, 0, false); err != nil {
		t.Error(err)
		return
	}
	ds, err := ch.Consume(r.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Error(err)
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case d, ok := <-ds:
			if !ok {
				return
			}
			handle(d)
		}
	}
}
