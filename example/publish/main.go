// Command publish publishes charge requests for the example consumer: a
// CreateChargeRequest in protobuf JSON, with a message id and the header
// "tenant", to NATS JetStream (-nats-url), RabbitMQ (-amqp-url) or Kafka
// (-kafka-brokers).
//
//	go run ./example/publish -nats-url nats://127.0.0.1:4222 -id order-1001 -customer cus_ada -amount 2500
//	go run ./example/publish -kafka-brokers 127.0.0.1:9092 -id order-1001 -customer cus_ada -amount 2500
//
// Publishing the same -id again is what a producer that retries does: the
// consumer charges once. With -count N it publishes N requests, with ids
// ID-1 to ID-N.
//
// An id is the tenant's own: acme's order-1001 and globex's are two charges.
// On JetStream the Nats-Msg-Id is the tenant, a slash and the id
// ("acme/order-1001"), since JetStream drops, within the stream's duplicate
// window, a message whose Nats-Msg-Id it stored, whichever the tenant; the
// consumer says so with consumer.WithMessageID(idemnats.UniqueMessageID).
// RabbitMQ and Kafka drop nothing themselves: the message-id property, or a
// Kafka record's message-id header, is the id.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/protobuf/encoding/protojson"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func main() {
	natsURL := flag.String("nats-url", "", "publish to NATS JetStream at this URL")
	amqpURL := flag.String("amqp-url", "", "publish to RabbitMQ at this URL")
	kafkaBrokers := flag.String("kafka-brokers", "", "publish to Kafka with these seed brokers (host:port, comma-separated)")
	topic := flag.String("topic", "payments.charges.requested", "Kafka: the topic")
	subject := flag.String("subject", "payments.charges.requested", "JetStream: the subject")
	queue := flag.String("queue", "payments.charges.requested", "RabbitMQ: the queue (published through the default exchange)")
	id := flag.String("id", "", "the message id: the same id is charged once")
	tenant := flag.String("tenant", "acme", "the tenant header: acme or globex")
	count := flag.Int("count", 1, "how many requests to publish, with ids ID-1 to ID-N when above 1")
	req := &paymentsv1.CreateChargeRequest{Currency: "EUR"}
	flag.StringVar(&req.CustomerId, "customer", "cus_ada", "the customer to charge")
	flag.Int64Var(&req.Amount, "amount", 2500, "the amount, in cents")
	flag.StringVar(&req.Description, "description", "", "the charge's description")
	flag.Parse()

	body, err := protojson.Marshal(req)
	if err == nil {
		if *kafkaBrokers != "" && *natsURL == "" && *amqpURL == "" {
			err = publishKafka(strings.Split(*kafkaBrokers, ","), *topic, *id, *tenant, *count, body)
		} else {
			err = publish(*natsURL, *amqpURL, *subject, *queue, *id, *tenant, *count, body)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "publish:", err)
		os.Exit(1)
	}
}

// publish publishes count messages with body, each confirmed by the broker.
func publish(natsURL, amqpURL, subject, queue, id, tenant string, count int, body []byte) error {
	if (natsURL == "") == (amqpURL == "") {
		return fmt.Errorf("give one of -nats-url, -amqp-url and -kafka-brokers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	idOf := func(n int) string {
		if count == 1 {
			return id
		}
		return fmt.Sprintf("%s-%d", id, n)
	}
	if natsURL != "" {
		nc, err := nats.Connect(natsURL)
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		for n := 1; n <= count; n++ {
			msg := nats.NewMsg(subject)
			msg.Data = body
			msg.Header.Set("tenant", tenant)
			if id != "" {
				msg.Header.Set(jetstream.MsgIDHeader, natsMsgID(tenant, idOf(n)))
			}
			ack, err := js.PublishMsg(ctx, msg)
			if err != nil {
				return err
			}
			fmt.Printf("published to stream %s, sequence %d, duplicate %v\n", ack.Stream, ack.Sequence, ack.Duplicate)
		}
		return nil
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	// A message no queue takes comes back (mandatory) before its confirm.
	returned := ch.NotifyReturn(make(chan amqp.Return, 1))
	for n := 1; n <= count; n++ {
		conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent,
			MessageId: idOf(n), Headers: amqp.Table{"tenant": tenant}, Body: body,
		})
		if err != nil {
			return err
		}
		if ok, err := conf.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("the broker did not confirm message %d (%v)", n, err)
		}
		select {
		case r := <-returned:
			return fmt.Errorf("queue %s does not exist, so the broker dropped message %d (%s): start the consumer first, which declares it", queue, n, r.ReplyText)
		default:
		}
		fmt.Printf("published to queue %s\n", queue)
	}
	return nil
}

// natsMsgID is the Nats-Msg-Id of tenant's message id: unique across
// tenants, so that JetStream's duplicate window, which knows no tenant, drops
// only the tenant's own resend.
func natsMsgID(tenant, id string) string { return tenant + "/" + id }

// publishKafka produces count records with body to topic, each with the
// message-id header (idemkafka.MessageID) and the tenant header, and waits
// until Kafka has each.
func publishKafka(brokers []string, topic, id, tenant string, count int, body []byte) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer cl.Close()
	for n := 1; n <= count; n++ {
		r := &kgo.Record{Topic: topic, Value: body, Headers: []kgo.RecordHeader{{Key: "tenant", Value: []byte(tenant)}}}
		if id != "" {
			msgID := id
			if count > 1 {
				msgID = fmt.Sprintf("%s-%d", id, n)
			}
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: "message-id", Value: []byte(msgID)})
		}
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			return err
		}
		fmt.Printf("published to topic %s, partition %d, offset %d\n", r.Topic, r.Partition, r.Offset)
	}
	return nil
}
