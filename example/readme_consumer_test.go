package example_test

// This file is docs/consumers.md's NATS JetStream snippet, between the
// markers; the page's copy must match it (TestREADMESnippets).

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/natstest"
)

// readme:consumer
// Charge once per message id: the charge and the id's record commit in one
// transaction, whatever dies when.
func consumeCharges(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream) (jetstream.ConsumeContext, error) {
	st, err := postgres.New(pool) // its tables: postgres.Migrate
	if err != nil {
		return nil, err
	}
	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention)) // 7 days
	if err != nil {
		return nil, err
	}
	stream, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: "PAYMENTS", Subjects: []string{"payments.charges.requested"},
		MaxAge: 72 * time.Hour, // no redelivery after 3 days; ids are kept for 7
	})
	if err != nil {
		return nil, err
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "charges", AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		return nil, err
	}
	b, err := idemnats.New(ctx, stream, cons) // the consumer.Broker of cons
	if err != nil {
		return nil, err
	}
	c, err := consumer.New(eng, "charges", b, func(ctx context.Context, msg jetstream.Msg) error {
		tx, ok := postgres.TxFromContext(ctx) // commits with the message's record
		if !ok {
			return errors.New("not in atomic mode (consumer.WithAtomic)") // redelivered, never lost
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (entry) VALUES ($1)`, msg.Data())
		return err
	}, consumer.WithAtomic(), consumer.WithDeadLetter(func(ctx context.Context, msg jetstream.Msg, err error) error {
		_, werr := pool.Exec(ctx, `INSERT INTO dead_letters (body, cause) VALUES ($1, $2)`,
			msg.Data(), consumer.Cause(err)) // Cause: idemkey's words, never the handler's
		return werr // an error redelivers the message, to try again
	}))
	if err != nil {
		return nil, err // a *consumer.HorizonError if ids could expire first
	}
	return cons.Consume(func(msg jetstream.Msg) { c.Handle(ctx, msg) })
}

// end readme

// TestREADMEConsumer runs the snippet on a NATS server of its own: a message
// published, then published again after JetStream's duplicate window, makes
// one ledger entry.
func TestREADMEConsumer(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.Connect(t)
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE ledger (entry text); CREATE TABLE dead_letters (body bytea, cause text)`); err != nil {
		t.Fatal(err)
	}
	cc, err := consumeCharges(t.Context(), pool, js)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cc.Stop(); <-cc.Closed() }()
	// The stream's duplicate window is shortened, so that the resend below
	// reaches the consumer rather than being dropped by JetStream.
	stream, err := js.Stream(t.Context(), "PAYMENTS")
	if err != nil {
		t.Fatal(err)
	}
	cfg := stream.CachedInfo().Config
	cfg.Duplicates = 100 * time.Millisecond
	if _, err := js.UpdateStream(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	publish := func() {
		msg := nats.NewMsg("payments.charges.requested")
		msg.Header.Set(jetstream.MsgIDHeader, "order-1001")
		msg.Data = []byte("charge cus_ada 2500 EUR")
		if _, err := js.PublishMsg(t.Context(), msg); err != nil {
			t.Fatal(err)
		}
	}
	publish()
	entries := func() (n int) {
		pool.QueryRow(t.Context(), `SELECT count(*) FROM ledger`).Scan(&n)
		return n
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 10s", what)
			}
		}
	}
	waitFor("the first entry", func() bool { return entries() == 1 })
	time.Sleep(200 * time.Millisecond)
	publish()
	cons, _ := stream.Consumer(t.Context(), "charges")
	waitFor("the resend acknowledged", func() bool {
		info, err := cons.Info(t.Context())
		return err == nil && info.Delivered.Stream == 2 && info.NumAckPending == 0 && info.NumPending == 0
	})
	if n := entries(); n != 1 {
		t.Fatalf("%d ledger entries, want 1", n)
	}
	var records int
	pool.QueryRow(t.Context(), `SELECT count(*) FROM idempotency_keys`).Scan(&records)
	if records != 1 {
		t.Fatalf("%d idempotency records, want 1", records)
	}
}
