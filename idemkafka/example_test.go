package idemkafka_test

import (
	"context"
	"log"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/store/memory"
)

// A consumer group's poll loop: a poll's records are processed together,
// their offsets committed once each is settled, and a record that fails for
// good or runs out of attempts goes to a dead-letter topic. It needs a
// Kafka cluster, so it does not run.
func Example() {
	ctx := context.Background()
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		log.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:9092"),
		kgo.ConsumerGroup("billing"), kgo.ConsumeTopics("orders"),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll()) // New checks both
	if err != nil {
		log.Fatal(err)
	}
	defer cl.CloseAllowingRebalance() // a poll holds rebalances, and so Close
	b, err := idemkafka.New(ctx, cl, idemkafka.WithMaxAttempts(3))
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(eng, "billing", b, func(ctx context.Context, r *kgo.Record) error {
		log.Printf("billing %d bytes", len(r.Value))
		return nil
	}, consumer.WithDeadLetter(idemkafka.DeadLetterTopic(cl, "orders-dlq")))
	if err != nil {
		log.Fatal(err) // a *consumer.HorizonError, if the topic keeps records longer than the ids
	}
	for {
		rs, err := idemkafka.NextBatch(ctx, cl, 32, 5*time.Millisecond)
		if err != nil {
			return // ctx done, or the client closed
		}
		c.HandleBatch(ctx, rs) // runs, dead-letters and commits
		cl.AllowRebalance()
	}
}
