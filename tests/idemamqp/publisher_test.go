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
	consume(ctx, t, r.conn, r.queue, handle)
}

// TestPublisherReopensChannel: the exchange a Publisher publishes to is
// deleted, which closes its channel; once the exchange is back, the next
// Publish opens another channel and the messages arrive. After Close,
// Publish fails.
func TestPublisherReopensChannel(t *testing.T) {
	conn := amqptest.Conn(t)
	queue := amqptest.Queue(t, conn, amqp.Table{"x-message-ttl": ttl})
	exchange := amqptest.Name("exchange")
	admin := amqptest.Channel(t, conn)
	declare := func() {
		t.Helper()
		if err := admin.ExchangeDeclare(exchange, amqp.ExchangeDirect, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := admin.QueueBind(queue, "charges", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	declare()
	t.Cleanup(func() { admin.ExchangeDelete(exchange, false, false) })
	pub, err := idemamqp.NewPublisher(amqptest.Conn(t), idemamqp.WithExchange(exchange))
	if err != nil {
		t.Fatal(err)
	}
	msg := func(id string) outbox.Message {
		return outbox.Message{ID: id, Destination: "charges", PartitionKey: id, Payload: []byte("body")}
	}
	if errs := pub.Publish(t.Context(), []outbox.Message{msg("m1"), msg("m2")}); errs != nil {
		t.Fatalf("Publish: %v", errs)
	}
	if err := admin.ExchangeDelete(exchange, false, false); err != nil {
		t.Fatal(err)
	}
	errs := pub.Publish(t.Context(), []outbox.Message{msg("m3")})
	if len(errs) != 1 || errs[0] == nil {
		t.Fatalf("Publish to a deleted exchange: %v, want its error", errs)
	}
	declare()
	if errs := pub.Publish(t.Context(), []outbox.Message{msg("m4")}); errs != nil {
		t.Fatalf("Publish once the exchange is back: %v, want a channel opened again", errs)
	}
	var got []string
	for {
		d, ok, err := admin.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		if d.DeliveryMode != amqp.Persistent {
			t.Errorf("message %s is not persistent", d.MessageId)
		}
		got = append(got, d.MessageId)
	}
	if fmt.Sprint(got) != "[m1 m2 m4]" {
		t.Fatalf("the queue holds %v, want [m1 m2 m4]", got)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if errs := pub.Publish(t.Context(), []outbox.Message{msg("m5")}); len(errs) != 1 || errs[0] == nil {
		t.Fatalf("Publish after Close: %v, want an error", errs)
	}
}
