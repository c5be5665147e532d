package idemamqp_test

import (
	"context"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/brokertest"
)

// TestSuite runs the broker suite on RabbitMQ, on a quorum queue.
func TestSuite(t *testing.T) {
	brokertest.Run(t, brokertest.Features{DeliveryLimit: true}, newSuiteRig)
}

// suiteRig is a quorum queue of its own and a channel that publishes to it
// with confirmations.
type suiteRig struct {
	conn  *amqp.Connection
	pub   *amqp.Channel
	queue string
	b     consumer.Broker[amqp.Delivery]
}

func newSuiteRig(t *testing.T, cfg brokertest.Config) brokertest.Rig[amqp.Delivery] {
	args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": ttl}
	if cfg.MaxDeliveries > 0 {
		// RabbitMQ counts the deliveries after the first.
		args["x-delivery-limit"] = cfg.MaxDeliveries - 1
	}
	conn := amqptest.Conn(t)
	queue := amqptest.Queue(t, conn, args)
	b, err := idemamqp.New(queue, args)
	if err != nil {
		t.Fatal(err)
	}
	pub := amqptest.Channel(t, conn)
	if err := pub.Confirm(false); err != nil {
		t.Fatal(err)
	}
	return &suiteRig{conn: conn, pub: pub, queue: queue, b: b}
}

func (r *suiteRig) Broker() consumer.Broker[amqp.Delivery] { return r.b }

func (r *suiteRig) Publish(t *testing.T, id, body string) {
	t.Helper()
	conf, err := r.pub.PublishWithDeferredConfirmWithContext(t.Context(), "", r.queue, true, false, amqp.Publishing{MessageId: id, Body: []byte(body)})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := conf.WaitContext(t.Context()); !ok || err != nil {
		t.Fatalf("publish not confirmed: %v", err)
	}
}

func (r *suiteRig) Consume(ctx context.Context, t *testing.T, handle func(amqp.Delivery)) {
	consume(ctx, t, r.conn, r.queue, handle)
}

// consume hands each delivery of queue to handle, one at a time (a
// prefetch of one), until ctx ends.
func consume(ctx context.Context, t *testing.T, conn *amqp.Connection, queue string, handle func(amqp.Delivery)) {
	ch, err := conn.Channel()
	if err != nil {
		t.Error(err)
		return
	}
	defer ch.Close()
	if err := ch.Qos(1, 0, false); err != nil {
		t.Error(err)
		return
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
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
