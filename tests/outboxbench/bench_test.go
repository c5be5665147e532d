// Package outboxbench measures what the outbox costs a handler in atomic
// mode on PostgreSQL: its message written in the call's transaction, against
// the same handler publishing to NATS JetStream once the call has returned,
// and against the handler publishing nothing.
package outboxbench

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/natstest"
)

// call is one keyed call whose handler is run: an engine.Exchange.
type call struct {
	key    string
	run    func(ctx context.Context) error
	answer engine.Answer
}

func (c *call) Key() (string, bool, error) { return c.key, true, nil }
func (c *call) FirstSent() []string        { return nil }
func (c *call) FirstRegion() []string      { return nil }
func (c *call) Attempt() engine.Attempt    { return engine.Attempt{} }
func (c *call) Fingerprint(context.Context) (store.Fingerprint, error) {
	return store.Fingerprint{1}, nil
}
func (c *call) StandIn(error) []byte         { return []byte("stand-in") }
func (c *call) Pass(ctx context.Context) int { _ = c.run(ctx); return 0 }
func (c *call) Answer(_ context.Context, a engine.Answer) int {
	c.answer = a
	return 0
}
func (c *call) Run(ctx context.Context) engine.HandlerResult {
	if err := c.run(ctx); err != nil {
		return engine.HandlerResult{Release: true}
	}
	return engine.HandlerResult{Record: []byte(`{"id":"ch"}`), KeepWrites: true}
}

// BenchmarkOutbox serves atomic calls on PostgreSQL whose handler inserts a
// charge through the call's transaction, interleaved: "none" publishes
// nothing; "outbox" also publishes one message through outbox.Publish, in
// the transaction (the relay sends it later, and is not running); "insert"
// writes the same row to the outbox table by hand, one INSERT without
// outbox.Publish's encoding, its unnest and its NOTIFY; "nats"
// publishes the same message to NATS JetStream, with its Nats-Msg-Id, after
// the engine has returned (committed), waiting for the stream's
// acknowledgement as a publish after commit must. It reports each one's time
// as a ratio to none's, and outbox's to insert's and to nats's.
func BenchmarkOutbox(b *testing.B) {
	ctx := context.Background()
	pool := pgtest.Pool(b, pgtest.Schema(b))
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (id text PRIMARY KEY, amount bigint NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		b.Fatal(err)
	}
	ob, err := outbox.New(st)
	if err != nil {
		b.Fatal(err)
	}
	e, err := engine.New(st, engine.WithSingleTenant())
	if err != nil {
		b.Fatal(err)
	}
	op, err := e.Operation(engine.OperationSpec{Name: "/example.payments.v1.PaymentService/CreateCharge", Atomic: true})
	if err != nil {
		b.Fatal(err)
	}
	_, js := natstest.Connect(b)
	stream := natstest.Stream(b, js, jetstream.StreamConfig{})
	subject := stream.CachedInfo().Config.Name + ".charge.created"

	payload := func(id string) []byte { return []byte(`{"charge":"` + id + `","amount":1250,"currency":"EUR"}`) }
	insert := func(ctx context.Context, id string) error {
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			return fmt.Errorf("no transaction")
		}
		_, err := tx.Exec(ctx, `INSERT INTO charges (id, amount) VALUES ($1, 1250)`, id)
		return err
	}
	serve := func(key string, run func(ctx context.Context) error) error {
		c := &call{key: key, run: run}
		e.Serve(ctx, op, c)
		if c.answer.Verdict != engine.Executed || c.answer.StandIn != nil {
			return fmt.Errorf("verdict %v", c.answer.Verdict)
		}
		return nil
	}
	run := idemkey.NewKey() // new keys on every run of the benchmark
	key := func(variant string, i int) string { return run + "-" + variant + "-" + strconv.Itoa(i) }

	means := benchtest.Interleave(b,
		benchtest.Op{Name: "none", Run: func(i int) error {
			k := key("none", i)
			return serve(k, func(ctx context.Context) error { return insert(ctx, k) })
		}},
		benchtest.Op{Name: "outbox", Run: func(i int) error {
			k := key("outbox", i)
			return serve(k, func(ctx context.Context) error {
				if err := insert(ctx, k); err != nil {
					return err
				}
				return ob.Publish(ctx, outbox.Message{Destination: subject, Payload: payload(k)})
			})
		}},
		benchtest.Op{Name: "insert", Run: func(i int) error {
			k := key("insert", i)
			return serve(k, func(ctx context.Context) error {
				if err := insert(ctx, k); err != nil {
					return err
				}
				tx, _ := postgres.TxFromContext(ctx)
				_, err := tx.Exec(ctx, `INSERT INTO idempotency_keys_outbox (id, partition_key, destination, body) VALUES ($1, $1, $2, $3)`,
					k, subject, payload(k))
				return err
			})
		}},
		benchtest.Op{Name: "nats", Run: func(i int) error {
			k := key("nats", i)
			if err := serve(k, func(ctx context.Context) error { return insert(ctx, k) }); err != nil {
				return err
			}
			_, err := js.Publish(ctx, subject, payload(k), jetstream.WithMsgID(k))
			return err
		}},
	)
	b.ReportMetric(means[1]/means[0], "outbox/none")
	b.ReportMetric(means[2]/means[0], "insert/none")
	b.ReportMetric(means[1]/means[2], "outbox/insert")
	b.ReportMetric(means[3]/means[0], "nats/none")
	b.ReportMetric(means[1]/means[3], "outbox/nats")
}
