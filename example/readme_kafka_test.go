package example_test

// This file is docs/consumers.md's Kafka snippet, between the markers; the
// page's copy must match it (TestREADMESnippets).

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// readme:kafka
// Charge once per message id from Kafka: a poll's charges and their ids'
// records commit in one transaction, then the poll's offsets in one commit.
func consumeKafkaCharges(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
	st, err := postgres.New(pool)
	if err != nil {
		return err
	}
	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention)) // 7 days
	if err != nil {
		return err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
		kgo.ConsumerGroup("charges"), kgo.ConsumeTopics("payments.charges.requested"),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll()) // idemkafka.New checks both
	if err != nil {
		return err
	}
	defer cl.CloseAllowingRebalance()
	b, err := idemkafka.New(ctx, cl) // the consumer.Broker of cl's records
	if err != nil {
		return err
	}
	c, err := consumer.New(eng, "charges", b, func(ctx context.Context, r *kgo.Record) error {
		tx, ok := postgres.TxFromContext(ctx) // commits with the record's id
		if !ok {
			return errors.New("not in atomic mode (consumer.WithAtomic)") // retried, never lost
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (entry) VALUES ($1)`, r.Value)
		return err
	}, consumer.WithAtomic(), consumer.WithDeadLetter(idemkafka.DeadLetterTopic(cl, "payments.charges.dead")))
	if err != nil {
		return err // a *consumer.HorizonError if the topic's retention.ms outlasts the ids
	}
	for {
		rs, err := idemkafka.NextBatch(ctx, cl, 32, 5*time.Millisecond) // ids: the message-id header
		if err != nil {
			return nil // ctx done
		}
		c.HandleBatch(ctx, rs)
		cl.AllowRebalance()
	}
}

// end readme

// TestREADMEKafka runs the snippet on kfake: a record produced twice, with
// one message-id, makes one ledger entry, and the group commits both.
func TestREADMEKafka(t *testing.T) {
	brokers := kafkatest.Brokers(t)
	for _, topic := range []string{"payments.charges.requested", "payments.charges.dead"} {
		kafkatest.TopicNamed(t, brokers, topic, 1, kafkatest.Retention(72*time.Hour, 24*time.Hour))
	}
	prod := kafkatest.Client(t, brokers)
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE ledger (entry text)`); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		r := &kgo.Record{Topic: "payments.charges.requested", Value: []byte("charge cus_ada 2500 EUR"),
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("order-1001")}}}
		if err := prod.ProduceSync(t.Context(), r).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- consumeKafkaCharges(ctx, pool, brokers) }()
	entries, records := func() (n int) {
		pool.QueryRow(t.Context(), `SELECT count(*) FROM ledger`).Scan(&n)
		return n
	}, func() (n int) {
		pool.QueryRow(t.Context(), `SELECT count(*) FROM idempotency_keys`).Scan(&n)
		return n
	}
	for deadline := time.Now().Add(10 * time.Second); kafkatest.Committed(t, brokers, "charges", "payments.charges.requested") < 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the group did not commit both records within 10s (%d entries)", entries())
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n, r := entries(), records(); n != 1 || r != 1 {
		t.Fatalf("%d ledger entries and %d idempotency records, want 1 and 1", n, r)
	}
}
