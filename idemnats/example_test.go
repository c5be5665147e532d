package idemnats_test

import (
	"context"
	"log"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/store/memory"
)

// A durable consumer of a stream whose messages live three days, well
// within the week the consumer keeps their ids; its dead letters go to a
// subject of their own. It needs a NATS server, so it does not run.
func Example() {
	ctx := context.Background()
	nc, err := nats.Connect("nats://127.0.0.1:4222")
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: "ORDERS", Subjects: []string{"orders.placed", "orders.dead"}, MaxAge: 72 * time.Hour,
	})
	if err != nil {
		log.Fatal(err)
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "billing", FilterSubject: "orders.placed", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 5,
	})
	if err != nil {
		log.Fatal(err)
	}
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		log.Fatal(err)
	}
	b, err := idemnats.New(ctx, stream, cons)
	if err != nil {
		log.Fatal(err) // a consumer that does not acknowledge explicitly, say
	}
	c, err := consumer.New(eng, "billing", b, func(ctx context.Context, msg jetstream.Msg) error {
		log.Printf("billing %d bytes", len(msg.Data()))
		return nil
	}, consumer.WithDeadLetter(func(ctx context.Context, msg jetstream.Msg, err error) error {
		dead := nats.NewMsg("orders.dead")
		dead.Data = msg.Data()
		dead.Header.Set("idemkey-error", consumer.Cause(err)) // idemkey's words, never the handler's
		_, err = js.PublishMsg(ctx, dead)
		return err // an error redelivers the message
	}))
	if err != nil {
		log.Fatal(err) // a *consumer.HorizonError, say
	}
	cc, err := cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Stop()
	<-ctx.Done()
}
