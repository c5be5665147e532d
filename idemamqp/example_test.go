package idemamqp_test

import (
	"context"
	"log"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/store/memory"
)

// A worker pool on a queue whose messages live a day, well within the
// week the consumer keeps their ids. It needs a broker, so it does not run.
func Example() {
	ctx := context.Background()
	conn, err := amqp.Dial("amqp://guest:guest@127.0.0.1:5672/")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	defer ch.Close()

	args := amqp.Table{"x-message-ttl": (24 * time.Hour).Milliseconds()}
	if _, err := ch.QueueDeclare("invoices", true, false, false, false, args); err != nil {
		log.Fatal(err)
	}
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		log.Fatal(err)
	}
	b, err := idemamqp.New("invoices", args) // the queue's args: AMQP cannot read them back
	if err != nil {
		log.Fatal(err)
	}
	// This example keeps no dead letters: it says so. A real consumer
	// gives consumer.WithDeadLetter a hook that keeps them.
	c, err := consumer.New(eng, "billing", b, func(ctx context.Context, d amqp.Delivery) error {
		log.Printf("billing %d bytes", len(d.Body))
		return nil
	}, consumer.WithDiscardDeadLetters())
	if err != nil {
		log.Fatal(err)
	}

	const workers = 8
	if err := ch.Qos(workers, 0, false); err != nil {
		log.Fatal(err)
	}
	deliveries, err := ch.Consume("invoices", "", false, false, false, false, nil)
	if err != nil {
		log.Fatal(err)
	}
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for d := range deliveries {
				if res := c.Handle(ctx, d); res.Err != nil {
					log.Printf("message: %v", res) // never res.Err: it may hold what the message held
				}
			}
		})
	}
	wg.Wait() // until the channel closes
}
