package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store"
)

// maxMessageAge is how long the stream, queue or topic the server creates
// for -outbox-destination keeps a message: the example consumer's
// MaxStreamAge, which its queue is declared with too (RabbitMQ refuses a
// second declaration with other arguments).
const maxMessageAge = 72 * time.Hour

// checkOutboxURL refuses an -outbox URL of no broker the relay knows.
func checkOutboxURL(u string) error {
	for _, scheme := range []string{"nats://", "amqp://", "amqps://", "kafka://"} {
		if strings.HasPrefix(u, scheme) && len(u) > len(scheme) {
			return nil
		}
	}
	return errors.New("-outbox takes nats://host:port, amqp://user:pass@host:port/ or kafka://host:port[,host:port]")
}

// brokerName names the broker of an -outbox URL for the log, without the
// URL, which may hold a password.
func brokerName(u string) string {
	switch {
	case strings.HasPrefix(u, "nats://"):
		return "nats"
	case strings.HasPrefix(u, "kafka://"):
		return "kafka"
	}
	return "rabbitmq"
}

// broker is a connection to the -outbox broker and the relay's Publisher
// on it.
type broker struct {
	pub   outbox.Publisher
	lost  <-chan struct{} // closed if the connection is lost for good; nil if it reconnects itself
	close func()
}

// openBroker connects to the broker of url and makes sure that destination
// takes messages there: a JetStream stream of the subject, a durable quorum
// queue, a topic, each created if missing, keeping messages maxMessageAge.
func openBroker(ctx context.Context, url, destination string) (*broker, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	switch brokerName(url) {
	case "nats":
		return openNATS(ctx, url, destination)
	case "kafka":
		return openKafka(ctx, strings.Split(strings.Trim(strings.TrimPrefix(url, "kafka://"), "/"), ","), destination)
	}
	return openAMQP(url, destination)
}

func openNATS(ctx context.Context, url, subject string) (*broker, error) {
	nc, err := nats.Connect(url, nats.Name("idemkey example relay"), nats.MaxReconnects(-1))
	if err != nil {
		return nil, fmt.Errorf("nats: %w", err)
	}
	// A PubAck is awaited at most this long: less than the relay's half
	// lease, as idemnats.NewPublisher asks.
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err == nil {
		_, err = js.StreamNameBySubject(ctx, subject)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			name := strings.ToUpper(strings.NewReplacer(".", "_", "*", "_", ">", "_").Replace(subject))
			_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}, MaxAge: maxMessageAge})
		}
	}
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: stream of %s: %w", subject, err)
	}
	pub, err := idemnats.NewPublisher(js)
	if err != nil {
		nc.Close()
		return nil, err
	}
	return &broker{pub: pub, close: nc.Close}, nil
}

func openAMQP(url, queue string) (*broker, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{
		Heartbeat: 10 * time.Second, Locale: "en_US", // amqp.Dial's
		Properties: amqp.Table{"connection_name": "idemkey example relay"},
	})
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: %w", err)
	}
	if err := declareQueue(conn, queue); err != nil {
		conn.Close()
		return nil, err
	}
	pub, err := idemamqp.NewPublisher(conn, idemamqp.WithExchange("")) // to the queue each Destination names
	if err != nil {
		conn.Close()
		return nil, err
	}
	lost := make(chan struct{})
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		<-closed
		close(lost)
	}()
	return &broker{pub: pub, lost: lost, close: func() { pub.Close(); conn.Close() }}, nil
}

// declareQueue declares queue as the example consumer does, durable and
// quorum, unless it exists: then it is taken as it is, whatever the
// consumer's -max-deliver added to its arguments.
func declareQueue(conn *amqp.Connection, queue string) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq: %w", err)
	}
	if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil {
		return ch.Close()
	}
	// The failed passive declaration closed the channel.
	if ch, err = conn.Channel(); err != nil {
		return fmt.Errorf("rabbitmq: %w", err)
	}
	defer ch.Close()
	args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": maxMessageAge.Milliseconds()}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, args); err != nil {
		return fmt.Errorf("rabbitmq: queue %s: %w", queue, err)
	}
	return nil
}

func openKafka(ctx context.Context, brokers []string, topic string) (*broker, error) {
	// Idempotent, acks=all; a record's delivery bounded within the relay's
	// half lease (kgo does not end one in flight at its context's end).
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ClientID("idemkey-example-relay"), kgo.RecordDeliveryTimeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	retention := fmt.Sprint(maxMessageAge.Milliseconds())
	segment := fmt.Sprint((24 * time.Hour).Milliseconds())
	_, err = kadm.NewClient(cl).CreateTopic(ctx, 4, -1, map[string]*string{"retention.ms": &retention, "segment.ms": &segment}, topic)
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		cl.Close()
		return nil, fmt.Errorf("kafka: create topic %s: %w", topic, err)
	}
	pub, err := idemkafka.NewPublisher(cl)
	if err != nil {
		cl.Close()
		return nil, err
	}
	return &broker{pub: pub, close: cl.Close}, nil
}

// runRelay relays ob's messages to the broker of cfg.outboxURL until ctx
// ends, connecting again a second after the broker could not be reached or
// its connection was lost for good. The API does not wait for the broker:
// a charge's message waits in the outbox while it is away.
func runRelay(ctx context.Context, ob *outbox.Outbox, cfg config, opts []outbox.RelayOption, logger *slog.Logger) error {
	for {
		b, err := openBroker(ctx, cfg.outboxURL, cfg.outboxDestination)
		if err != nil {
			logger.Warn("relay: the broker cannot be reached; trying again", "broker", brokerName(cfg.outboxURL), "error", err)
		} else {
			logger.Info("relay running", "broker", brokerName(cfg.outboxURL), "destination", cfg.outboxDestination)
			err = relayOn(ctx, ob, b, opts, logger)
			b.close()
			if err != nil {
				return err
			}
		}
		if !store.Pause(ctx, time.Second) {
			return ctx.Err()
		}
	}
}

// relayOn runs a relay on b until ctx ends or b's connection is lost.
func relayOn(ctx context.Context, ob *outbox.Outbox, b *broker, opts []outbox.RelayOption, logger *slog.Logger) error {
	relay, err := ob.Relay(b.pub, opts...)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if b.lost != nil {
		go func() {
			select {
			case <-b.lost:
				logger.Warn("relay: the broker's connection was lost; connecting again")
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	_ = relay.Run(ctx)
	return nil
}
