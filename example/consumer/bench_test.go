package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/natstest"
)

// Each round consumes benchBatch messages of each variant, in chunks of
// benchChunk taken in turn, so that noise on a shared machine (another
// process, a slow WAL flush) hits all variants alike.
const (
	benchBatch = 500
	benchChunk = 50
)

// benchVariants are the consumers each broker's benchmark compares, all
// running the example's CreateCharge on the PostgreSQL ledger:
//   - bare: no idemkey; the charge commits on its own and the message is
//     acknowledged directly;
//   - atomic: through the adapter's Handle, on store/postgres with
//     consumer.WithAtomic: the charge commits with the message's record;
//   - two-phase: the same without WithAtomic: reserve, charge and record
//     commit each on their own.
var benchVariants = []string{"bare", "atomic", "two-phase"}

// BenchmarkConsumer measures messages per second of the example consumer on
// each broker (NATS JetStream, RabbitMQ), with idemkey in atomic and
// two-phase mode, against the same consumer without it, on one PostgreSQL
// database: each variant on its own stream or queue and its own schema, with
// a pool of pgxpool's default size, as the command's. Each variant's
// consumer runs throughout, and stops before each message until it is let
// go on. One iteration is one round: benchBatch messages with unique ids are
// published to each variant (not timed), then let go in chunks of
// benchChunk, a chunk of each variant in turn in rotating order, each timed
// from its letting go to its last message's acknowledgement. It reports each
// variant's messages per second ("<variant>-msgs/s") and the ratio of each
// mode's to bare's ("atomic/bare", "two-phase/bare": below 1 is slower).
//
// Each broker is consumed as the command consumes it: JetStream through one
// Consume callback, one message at a time; RabbitMQ by four workers on a
// prefetch of four.
//
//	go test -run='^$' -bench=Consumer -benchtime=1x -count=10 ./example/consumer/
func BenchmarkConsumer(b *testing.B) {
	b.Run("nats", func(b *testing.B) { benchConsumer(b, newNATSBench(b)) })
	b.Run("rabbitmq", func(b *testing.B) { benchConsumer(b, newAMQPBench(b)) })
}

// benchQueue is one variant's stream or queue.
type benchQueue interface {
	// publish publishes n charge requests with unique ids, and returns once
	// the broker holds them all.
	publish(ctx context.Context, n int) error
	// consume starts consuming until t ends, passing each message to
	// g.process, which waits for it to be let go, then processes and
	// acknowledges it.
	consume(t testing.TB, g *benchGate)
}

// benchBroker makes one variant's queue: core is idemkey's consumer, nil
// for bare.
type benchBroker func(b *testing.B, w *worker, core *consumer.Consumer) benchQueue

// benchGate holds each message of one variant until it is let go, and
// reports when it has been processed and acknowledged.
type benchGate struct {
	handle func(ctx context.Context, msg any) error
	tokens chan struct{}
	done   chan error
	stop   chan struct{}
}

func newBenchGate() *benchGate {
	return &benchGate{tokens: make(chan struct{}, benchBatch), done: make(chan error, benchBatch), stop: make(chan struct{})}
}

// process waits to be let go, then handles msg; it returns false once the
// benchmark has stopped.
func (g *benchGate) process(ctx context.Context, msg any) bool {
	select {
	case <-g.tokens:
	case <-g.stop:
		return false
	}
	g.done <- g.handle(ctx, msg)
	return true
}

// run lets n messages go and returns how long they took to be processed.
func (g *benchGate) run(n int) (time.Duration, error) {
	start := time.Now()
	for range n {
		g.tokens <- struct{}{}
	}
	for i := range n {
		select {
		case err := <-g.done:
			if err != nil {
				return 0, err
			}
		case <-time.After(30 * time.Second):
			return 0, fmt.Errorf("only %d of %d messages processed in 30s", i, n)
		}
	}
	return time.Since(start), nil
}

func benchConsumer(b *testing.B, broker benchBroker) {
	ctx := context.Background()
	logger := slog.New(slog.DiscardHandler)
	gates := make([]*benchGate, len(benchVariants))
	queues := make([]benchQueue, len(benchVariants))
	for i, name := range benchVariants {
		pool := benchPool(b)
		w := &worker{svc: example.NewService(example.NewPostgresLedger(pool), 0), logger: logger}
		var core *consumer.Consumer
		if name != "bare" {
			st, err := postgres.New(pool, postgres.WithLogger(logger))
			if err != nil {
				b.Fatal(err)
			}
			opts := []consumer.Option{consumer.WithLogger(logger)}
			if name == "atomic" {
				opts = append(opts, consumer.WithAtomic())
			}
			if core, err = consumer.New(st, "charges", opts...); err != nil {
				b.Fatal(err)
			}
		}
		gates[i] = newBenchGate()
		queues[i] = broker(b, w, core)
		queues[i].consume(b, gates[i])
		// Warm up: connections, prepared statements, the broker's consumer.
		if err := queues[i].publish(ctx, benchChunk); err != nil {
			b.Fatal(err)
		}
		if _, err := gates[i].run(benchChunk); err != nil {
			b.Fatalf("%s: %v", name, err)
		}
	}
	spent := make([]time.Duration, len(queues))
	n := 0
	for b.Loop() {
		for _, q := range queues {
			if err := q.publish(ctx, benchBatch); err != nil {
				b.Fatal(err)
			}
		}
		for c := range benchBatch / benchChunk {
			for j := range gates {
				k := (n*benchBatch/benchChunk + c + j) % len(gates)
				d, err := gates[k].run(benchChunk)
				if err != nil {
					b.Fatalf("%s: %v", benchVariants[k], err)
				}
				spent[k] += d
			}
		}
		n++
	}
	rates := make([]float64, len(queues))
	for i, name := range benchVariants {
		rates[i] = float64(n*benchBatch) / spent[i].Seconds()
		b.ReportMetric(rates[i], name+"-msgs/s")
	}
	for i := 1; i < len(rates); i++ {
		b.ReportMetric(rates[i]/rates[0], benchVariants[i]+"/bare")
	}
}

// benchPool returns a pool on a schema of its own, with the idempotency
// table and the ledger's.
func benchPool(b *testing.B) *pgxpool.Pool {
	pool := pgtest.Pool(b, pgtest.Schema(b))
	if err := postgres.Migrate(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	if err := example.MigrateLedger(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	return pool
}

// benchBody is every message's body: a charge request in protobuf JSON.
var benchBody, _ = protojson.Marshal(&paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"})

// benchProcessed fails a message that idemkey did not process.
func benchProcessed(res consumer.Result) error {
	if res.Outcome != consumer.Processed {
		return fmt.Errorf("a message was %s: %v", res, res.Err)
	}
	return nil
}

// natsBench is one variant's JetStream stream and durable consumer.
type natsBench struct {
	js      jetstream.JetStream
	subject string
	cons    jetstream.Consumer
	handle  func(ctx context.Context, msg jetstream.Msg) error // processes and acknowledges
	sent    int
}

func newNATSBench(b *testing.B) benchBroker {
	_, js := natstest.Connect(b)
	return func(b *testing.B, w *worker, core *consumer.Consumer) benchQueue {
		ctx := context.Background()
		stream := natstest.Stream(b, js, jetstream.StreamConfig{MaxAge: MaxStreamAge})
		cons, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			Durable: "charges", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		})
		if err != nil {
			b.Fatal(err)
		}
		q := &natsBench{js: js, subject: stream.CachedInfo().Config.Name + ".charges", cons: cons}
		if core == nil {
			q.handle = func(ctx context.Context, msg jetstream.Msg) error {
				t, err := tenant(msg.Headers().Values("tenant"))
				if err != nil {
					return err
				}
				if err := w.charge(ctx, t, msg.Data()); err != nil {
					return err
				}
				return msg.Ack()
			}
			return q
		}
		c, err := idemnats.New(ctx, core, stream, cons,
			func(ctx context.Context, msg jetstream.Msg) error {
				t, _ := tenant(msg.Headers().Values("tenant")) // checked by WithTenant
				return w.charge(ctx, t, msg.Data())
			},
			idemnats.WithMessageTenant(func(msg jetstream.Msg) (string, error) { return tenant(msg.Headers().Values("tenant")) }),
			idemnats.WithMessageIDsUniqueAcrossTenants(),
		)
		if err != nil {
			b.Fatal(err)
		}
		q.handle = func(ctx context.Context, msg jetstream.Msg) error { return benchProcessed(c.Handle(ctx, msg)) }
		return q
	}
}

func (q *natsBench) publish(ctx context.Context, n int) error {
	acks := make([]jetstream.PubAckFuture, n)
	for i := range acks {
		msg := nats.NewMsg(q.subject)
		msg.Data = benchBody
		msg.Header.Set(jetstream.MsgIDHeader, "acme/"+strconv.Itoa(q.sent))
		msg.Header.Set("tenant", "acme")
		q.sent++
		var err error
		if acks[i], err = q.js.PublishMsgAsync(msg); err != nil {
			return err
		}
	}
	for _, a := range acks {
		select {
		case <-a.Ok():
		case err := <-a.Err():
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// consume runs one Consume callback, which processes one message at a time,
// as the command does.
func (q *natsBench) consume(t testing.TB, g *benchGate) {
	g.handle = func(ctx context.Context, msg any) error { return q.handle(ctx, msg.(jetstream.Msg)) }
	stopped := false
	cc, err := q.cons.Consume(func(msg jetstream.Msg) {
		if !stopped {
			stopped = !g.process(context.Background(), msg)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		close(g.stop)
		cc.Stop()
		<-cc.Closed()
	})
}

// amqpBench is one variant's RabbitMQ queue, declared as the command
// declares its own.
type amqpBench struct {
	conn   *amqp.Connection
	pub    *amqp.Channel
	queue  string
	handle func(ctx context.Context, d amqp.Delivery) error // processes and acknowledges
	sent   int
}

// amqpWorkers is the command's default -workers: messages processed at once,
// and the prefetch.
const amqpWorkers = 4

func newAMQPBench(b *testing.B) benchBroker {
	conn := amqptest.Conn(b)
	return func(b *testing.B, w *worker, core *consumer.Consumer) benchQueue {
		args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": MaxStreamAge.Milliseconds()}
		q := &amqpBench{conn: conn, pub: amqptest.Channel(b, conn), queue: amqptest.Queue(b, conn, args)}
		if err := q.pub.Confirm(false); err != nil {
			b.Fatal(err)
		}
		if core == nil {
			q.handle = func(ctx context.Context, d amqp.Delivery) error {
				t, err := tenant(headerValues(d.Headers, "tenant"))
				if err != nil {
					return err
				}
				if err := w.charge(ctx, t, d.Body); err != nil {
					return err
				}
				return d.Ack(false)
			}
			return q
		}
		c, err := idemamqp.New(core, q.queue, args,
			func(ctx context.Context, d amqp.Delivery) error {
				t, _ := tenant(headerValues(d.Headers, "tenant")) // checked by WithTenant
				return w.charge(ctx, t, d.Body)
			},
			idemamqp.WithMessageTenant(func(d amqp.Delivery) (string, error) { return tenant(headerValues(d.Headers, "tenant")) }),
		)
		if err != nil {
			b.Fatal(err)
		}
		q.handle = func(ctx context.Context, d amqp.Delivery) error { return benchProcessed(c.Handle(ctx, d)) }
		return q
	}
}

func (q *amqpBench) publish(ctx context.Context, n int) error {
	confs := make([]*amqp.DeferredConfirmation, n)
	for i := range confs {
		var err error
		confs[i], err = q.pub.PublishWithDeferredConfirmWithContext(ctx, "", q.queue, true, false, amqp.Publishing{
			MessageId: strconv.Itoa(q.sent), Headers: amqp.Table{"tenant": "acme"}, Body: benchBody,
			DeliveryMode: amqp.Persistent,
		})
		if err != nil {
			return err
		}
		q.sent++
	}
	for _, c := range confs {
		ok, err := c.WaitContext(ctx)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("the broker refused a message")
		}
	}
	return nil
}

// consume runs amqpWorkers workers on a prefetch of as many, as the command
// does.
func (q *amqpBench) consume(t testing.TB, g *benchGate) {
	g.handle = func(ctx context.Context, msg any) error { return q.handle(ctx, msg.(amqp.Delivery)) }
	ch := amqptest.Channel(t, q.conn)
	if err := ch.Qos(amqpWorkers, 0, false); err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(q.queue, "bench", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range amqpWorkers {
		wg.Go(func() {
			for d := range deliveries {
				if !g.process(context.Background(), d) {
					return
				}
			}
		})
	}
	t.Cleanup(func() {
		close(g.stop)
		ch.Close() // ends deliveries
		wg.Wait()
	})
}
