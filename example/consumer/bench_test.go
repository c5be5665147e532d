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
	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/kafkatest"
	"github.com/idemkey/idemkey/tests/natstest"
)

// Each round consumes benchRound messages of each variant, in chunks of
// benchChunk taken in turn, so that noise on a shared machine (another
// process, a slow WAL flush) hits all variants alike. A chunk is four
// batches of benchBatchSize, so that each RabbitMQ worker of a batching
// variant takes one full batch of it.
const (
	benchRound     = 512
	benchChunk     = 128
	benchBatchSize = 32
)

// benchVariant is one consumer the benchmarks compare, all running the
// example's CreateCharge on the PostgreSQL ledger.
type benchVariant struct {
	name  string
	mode  string // "": no idemkey; "tx": no idemkey, each charge in a transaction of its own; "atomic" or "two-phase"
	batch int    // messages taken at once
}

// idemkey reports whether v runs through idemkey's consumer.
func (v benchVariant) idemkey() bool { return v.mode == "atomic" || v.mode == "two-phase" }

// benchVariants are the consumers each broker's benchmark compares (see
// benchPool for their pools):
//   - bare: no idemkey; the charge commits on its own and the message is
//     acknowledged directly, one message at a time;
//   - bare-tx: the same, the charge in a transaction of its own (BEGIN,
//     INSERT, COMMIT), as atomic mode's is: the price of the transaction
//     alone, the floor under atomic mode one message at a time;
//   - atomic: through the consumer's Handle, on store/postgres with
//     consumer.WithAtomic: the charge commits with the message's record;
//   - two-phase: the same without WithAtomic: reserve, charge and record
//     commit each on their own;
//   - bare-batch: no idemkey, batches of benchBatchSize: the batch's
//     charges commit in one transaction, then its messages are
//     acknowledged;
//   - atomic-batch: the consumer's HandleBatch in atomic mode, batches of
//     benchBatchSize: one round trip dedups the batch, its charges and
//     records commit in one transaction, a savepoint apart each;
//   - two-phase-batch: HandleBatch in two-phase mode: one statement
//     reserves the batch's ids, then each charge and each record commits
//     on its own.
var benchVariants = []benchVariant{
	{"bare", "", 1},
	{"bare-tx", "tx", 1},
	{"atomic", "atomic", 1},
	{"two-phase", "two-phase", 1},
	{"bare-batch", "", benchBatchSize},
	{"atomic-batch", "atomic", benchBatchSize},
	{"two-phase-batch", "two-phase", benchBatchSize},
}

// benchRatios are the ratios of messages per second each benchmark reports.
var benchRatios = [][2]string{
	{"atomic", "bare"},
	{"atomic", "bare-tx"},
	{"bare-tx", "bare"},
	{"two-phase", "bare"},
	{"atomic-batch", "bare-batch"},
	{"atomic-batch", "bare"},
	{"bare-batch", "bare"},
	{"two-phase-batch", "two-phase"},
}

// BenchmarkConsumer measures messages per second of the example consumer on
// each broker (NATS JetStream, RabbitMQ), with idemkey in atomic and
// two-phase mode, one message at a time and in batches, against the same
// consumer without it, on one PostgreSQL database: each variant on its own
// stream or queue and its own schema, with a pool of pgxpool's default
// size, as the command's. Each variant's consumer runs throughout, and
// stops before each message until it is let go on. One iteration is one
// round: benchRound messages with unique ids are published to each variant
// (not timed), then let go in chunks of benchChunk, a chunk of each variant
// in turn in rotating order, each timed from its letting go to its last
// message's acknowledgement. It reports each variant's messages per second
// ("<variant>-msgs/s") and the ratios of benchRatios ("atomic/bare",
// "atomic-batch/bare-batch", ...: below 1 is slower).
//
// Each broker is consumed as the command consumes it: JetStream through one
// Consume callback, one message at a time, or with -batch through one loop
// of idemnats.NextBatch on a Messages iterator; RabbitMQ by four workers on
// a prefetch of four, or with -batch four workers that each take a batch
// (idemamqp.NextBatch) on a prefetch of four batches; Kafka (kfake, in the
// benchmark's process) by one loop of polls of a topic of one partition,
// each record committed on its own (the bare consumer: a CommitRecords
// after each charge), or with -batch each batch's records in one commit. A batching variant
// takes whole batches of benchBatchSize: a chunk lets four go.
//
//	go test -run='^$' -bench=Consumer -benchtime=1x -count=10 ./example/consumer/
func BenchmarkConsumer(b *testing.B) {
	b.Run("nats", func(b *testing.B) { benchConsumer(b, newNATSBench(b)) })
	b.Run("rabbitmq", func(b *testing.B) { benchConsumer(b, newAMQPBench(b)) })
	b.Run("kafka", func(b *testing.B) { benchConsumer(b, newKafkaBench(b)) })
}

// benchQueue is one variant's stream or queue.
type benchQueue interface {
	// publish publishes n charge requests with unique ids, and returns once
	// the broker holds them all.
	publish(ctx context.Context, n int) error
	// consume starts consuming until t ends: it takes as many messages as
	// g lets go, up to the variant's batch, and passes them to g.handle,
	// which processes and acknowledges them.
	consume(t testing.TB, g *benchGate)
}

// benchBroker makes one variant's queue: eng is idemkey's engine and opts
// the consumer's options (newConsumer's), eng nil for bare; pool is the
// variant's database.
type benchBroker func(b *testing.B, v benchVariant, w *worker, pool *pgxpool.Pool, eng *engine.Engine, opts []consumer.Option) benchQueue

// benchGate holds the messages of one variant until they are let go, and
// reports when they have been processed and acknowledged.
type benchGate struct {
	batch  int
	handle func(ctx context.Context, msgs []any) error
	done   chan error

	mu      sync.Mutex
	cond    *sync.Cond
	tokens  int // messages let go, not yet taken
	stopped bool
}

func newBenchGate(batch int) *benchGate {
	g := &benchGate{batch: batch, done: make(chan error, benchRound)}
	g.cond = sync.NewCond(&g.mu)
	return g
}

// take waits until messages are let go, and takes as many as it may, up to
// the variant's batch; 0 once the benchmark has stopped.
func (g *benchGate) take() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.tokens == 0 && !g.stopped {
		g.cond.Wait()
	}
	if g.stopped {
		return 0
	}
	n := min(g.tokens, g.batch)
	g.tokens -= n
	return n
}

func (g *benchGate) stop() {
	g.mu.Lock()
	g.stopped = true
	g.mu.Unlock()
	g.cond.Broadcast()
}

// processed reports msgs processed, with err.
func (g *benchGate) processed(ctx context.Context, msgs []any) {
	err := g.handle(ctx, msgs)
	for range msgs {
		g.done <- err
	}
}

// run lets n messages go and returns how long they took to be processed.
func (g *benchGate) run(n int) (time.Duration, error) {
	start := time.Now()
	g.mu.Lock()
	g.tokens += n
	g.mu.Unlock()
	g.cond.Broadcast()
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
	for i, v := range benchVariants {
		pool := benchPool(b, v.batch)
		w := &worker{svc: example.NewService(example.NewPostgresLedger(pool), 0), logger: logger}
		var (
			eng  *engine.Engine
			opts []consumer.Option
		)
		if v.idemkey() {
			st, err := postgres.New(pool, postgres.WithLogger(logger), postgres.WithAtomicConns(benchSlots(v.batch)))
			if err != nil {
				b.Fatal(err)
			}
			if eng, err = engine.New(st, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(logger)); err != nil {
				b.Fatal(err)
			}
			if v.mode == "atomic" {
				opts = append(opts, consumer.WithAtomic())
			}
		}
		gates[i] = newBenchGate(v.batch)
		queues[i] = broker(b, v, w, pool, eng, opts)
		queues[i].consume(b, gates[i])
		// Warm up: connections, prepared statements, the broker's consumer.
		if err := queues[i].publish(ctx, benchChunk); err != nil {
			b.Fatal(err)
		}
		if _, err := gates[i].run(benchChunk); err != nil {
			b.Fatalf("%s: %v", v.name, err)
		}
	}
	spent := make([]time.Duration, len(queues))
	n := 0
	for b.Loop() {
		for _, q := range queues {
			if err := q.publish(ctx, benchRound); err != nil {
				b.Fatal(err)
			}
		}
		for c := range benchRound / benchChunk {
			for j := range gates {
				k := (n*benchRound/benchChunk + c + j) % len(gates)
				d, err := gates[k].run(benchChunk)
				if err != nil {
					b.Fatalf("%s: %v", benchVariants[k].name, err)
				}
				spent[k] += d
			}
		}
		n++
	}
	rates := map[string]float64{}
	for i, v := range benchVariants {
		rates[v.name] = float64(n*benchRound) / spent[i].Seconds()
		b.ReportMetric(rates[v.name], v.name+"-msgs/s")
	}
	for _, r := range benchRatios {
		b.ReportMetric(rates[r[0]]/rates[r[1]], r[0]+"/"+r[1])
	}
}

// benchSlots is the store's WithAtomicConns for a variant that takes
// batches of batch: as the command sizes it for RabbitMQ, a transaction for
// each worker's batch (NATS's one loop needs one); 0, the default, one at
// a time.
func benchSlots(batch int) int {
	if batch > 1 {
		return amqpWorkers
	}
	return 0
}

// benchPool returns a pool on a schema of its own, with the idempotency
// table and the ledger's: of pgxpool's default size, or with batches, as
// the command sizes it, one more connection than the transactions
// (benchSlots), for bare-batch too.
func benchPool(b *testing.B, batch int) *pgxpool.Pool {
	pool := pgtest.Pool(b, pgtest.Schema(b), func(c *pgxpool.Config) {
		c.MaxConns = max(c.MaxConns, int32(benchSlots(batch)+1))
	})
	if err := postgres.Migrate(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	if err := example.MigrateLedger(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	return pool
}

// benchConfig is the command's configuration that newConsumer reads: the
// consumer's name.
var benchConfig = config{name: "charges"}

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
	batch   int
	handle  func(ctx context.Context, msgs []jetstream.Msg) error // processes and acknowledges
	sent    int
}

func newNATSBench(b *testing.B) benchBroker {
	_, js := natstest.Connect(b)
	return func(b *testing.B, v benchVariant, w *worker, pool *pgxpool.Pool, eng *engine.Engine, opts []consumer.Option) benchQueue {
		ctx := context.Background()
		stream := natstest.Stream(b, js, jetstream.StreamConfig{MaxAge: MaxStreamAge})
		cons, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			Durable: "charges", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		})
		if err != nil {
			b.Fatal(err)
		}
		q := &natsBench{js: js, subject: stream.CachedInfo().Config.Name + ".charges", cons: cons, batch: v.batch}
		if eng == nil {
			q.handle = func(ctx context.Context, msgs []jetstream.Msg) error {
				if err := bareCharges(ctx, v, w, pool, len(msgs), func(i int) ([]string, []byte) { return msgs[i].Headers().Values("tenant"), msgs[i].Data() }); err != nil {
					return err
				}
				for _, msg := range msgs {
					if err := msg.Ack(); err != nil {
						return err
					}
				}
				return nil
			}
			return q
		}
		nb, err := idemnats.New(ctx, stream, cons)
		if err != nil {
			b.Fatal(err)
		}
		c, err := newConsumer(eng, benchConfig, opts, w, nb,
			func(msg jetstream.Msg) (string, error) { return tenant(msg.Headers().Values("tenant")) },
			jetstream.Msg.Data,
			consumer.WithMessageID(idemnats.UniqueMessageID),
		)
		if err != nil {
			b.Fatal(err)
		}
		q.handle = func(ctx context.Context, msgs []jetstream.Msg) error {
			if len(msgs) == 1 && v.batch == 1 {
				return benchProcessed(c.Handle(ctx, msgs[0]))
			}
			for _, res := range c.HandleBatch(ctx, msgs) {
				if err := benchProcessed(res); err != nil {
					return err
				}
			}
			return nil
		}
		return q
	}
}

// bareCharges makes n charges for v, message i's tenant and body as msg(i)
// says: one, committed on its own (but for bare-tx), or in one transaction.
func bareCharges(ctx context.Context, v benchVariant, w *worker, pool *pgxpool.Pool, n int, msg func(i int) (tenants []string, body []byte)) error {
	if n == 1 && v.mode != "tx" {
		tenants, body := msg(0)
		t, err := tenant(tenants)
		if err != nil {
			return err
		}
		return w.charge(ctx, t, body)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	for i := range n {
		tenants, body := msg(i)
		t, err := tenant(tenants)
		if err != nil {
			return err
		}
		if err := w.charge(postgres.ContextWithTx(ctx, tx), t, body); err != nil {
			return err
		}
	}
	return tx.Commit(ctx)
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

// consume consumes as the command does: one at a time through one Consume
// callback, or batches through one loop of idemnats.NextBatch.
func (q *natsBench) consume(t testing.TB, g *benchGate) {
	g.handle = func(ctx context.Context, msgs []any) error {
		ms := make([]jetstream.Msg, len(msgs))
		for i, m := range msgs {
			ms[i] = m.(jetstream.Msg)
		}
		return q.handle(ctx, ms)
	}
	if q.batch == 1 {
		stopped := false
		cc, err := q.cons.Consume(func(msg jetstream.Msg) {
			if !stopped {
				stopped = g.take() == 0
			}
			if !stopped {
				g.processed(context.Background(), []any{msg})
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			g.stop()
			cc.Stop()
			<-cc.Closed()
		})
		return
	}
	it, err := q.cons.Messages(jetstream.PullMaxMessages(2 * q.batch))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			n := g.take()
			if n == 0 {
				return
			}
			var msgs []any
			for len(msgs) < n {
				batch, err := idemnats.NextBatch(ctx, it, n-len(msgs), 5*time.Millisecond)
				if err != nil {
					return
				}
				for _, m := range batch {
					msgs = append(msgs, m)
				}
			}
			g.processed(context.Background(), msgs)
		}
	})
	t.Cleanup(func() {
		g.stop()
		cancel()
		it.Stop()
		wg.Wait()
	})
}

// amqpBench is one variant's RabbitMQ queue, declared as the command
// declares its own.
type amqpBench struct {
	conn   *amqp.Connection
	pub    *amqp.Channel
	queue  string
	batch  int
	handle func(ctx context.Context, ds []amqp.Delivery) error // processes and acknowledges
	sent   int
}

// amqpWorkers is the command's default -workers: messages (or batches)
// processed at once, and the prefetch (of messages, or batches).
const amqpWorkers = 4

func newAMQPBench(b *testing.B) benchBroker {
	conn := amqptest.Conn(b)
	return func(b *testing.B, v benchVariant, w *worker, pool *pgxpool.Pool, eng *engine.Engine, opts []consumer.Option) benchQueue {
		args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": MaxStreamAge.Milliseconds()}
		q := &amqpBench{conn: conn, pub: amqptest.Channel(b, conn), queue: amqptest.Queue(b, conn, args), batch: v.batch}
		if err := q.pub.Confirm(false); err != nil {
			b.Fatal(err)
		}
		if eng == nil {
			q.handle = func(ctx context.Context, ds []amqp.Delivery) error {
				if err := bareCharges(ctx, v, w, pool, len(ds), func(i int) ([]string, []byte) { return headerValues(ds[i].Headers, "tenant"), ds[i].Body }); err != nil {
					return err
				}
				for _, d := range ds {
					if err := d.Ack(false); err != nil {
						return err
					}
				}
				return nil
			}
			return q
		}
		qb, err := idemamqp.New(q.queue, args)
		if err != nil {
			b.Fatal(err)
		}
		c, err := newConsumer(eng, benchConfig, opts, w, qb,
			func(d amqp.Delivery) (string, error) { return tenant(headerValues(d.Headers, "tenant")) },
			func(d amqp.Delivery) []byte { return d.Body },
		)
		if err != nil {
			b.Fatal(err)
		}
		q.handle = func(ctx context.Context, ds []amqp.Delivery) error {
			if len(ds) == 1 && v.batch == 1 {
				return benchProcessed(c.Handle(ctx, ds[0]))
			}
			for _, res := range c.HandleBatch(ctx, ds) {
				if err := benchProcessed(res); err != nil {
					return err
				}
			}
			return nil
		}
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

// consume runs amqpWorkers workers on a prefetch of as many messages, or
// batches, as the command does.
func (q *amqpBench) consume(t testing.TB, g *benchGate) {
	g.handle = func(ctx context.Context, msgs []any) error {
		ds := make([]amqp.Delivery, len(msgs))
		for i, m := range msgs {
			ds[i] = m.(amqp.Delivery)
		}
		return q.handle(ctx, ds)
	}
	ch := amqptest.Channel(t, q.conn)
	if err := ch.Qos(amqpWorkers*q.batch, 0, false); err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(q.queue, "bench", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range amqpWorkers {
		wg.Go(func() {
			for {
				n := g.take()
				if n == 0 {
					return
				}
				var msgs []any
				for len(msgs) < n {
					ds := idemamqp.NextBatch(context.Background(), deliveries, n-len(msgs), 5*time.Millisecond)
					if ds == nil {
						return
					}
					for _, d := range ds {
						msgs = append(msgs, d)
					}
				}
				g.processed(context.Background(), msgs)
			}
		})
	}
	t.Cleanup(func() {
		g.stop()
		ch.Close() // ends deliveries
		wg.Wait()
	})
}

// kafkaBench is one variant's topic of one partition, and its group.
type kafkaBench struct {
	prod   *kgo.Client
	cl     *kgo.Client
	topic  string
	batch  int
	next   func(ctx context.Context, n int) ([]*kgo.Record, error)
	handle func(ctx context.Context, rs []*kgo.Record) error // processes and commits
	sent   int
}

func newKafkaBench(b *testing.B) benchBroker {
	brokers := kafkatest.Brokers(b)
	prod := kafkatest.Client(b, brokers, kgo.ProducerLinger(0))
	return func(b *testing.B, v benchVariant, w *worker, pool *pgxpool.Pool, eng *engine.Engine, opts []consumer.Option) benchQueue {
		ctx := context.Background()
		topic := kafkatest.Topic(b, brokers, "charges", 1, kafkatest.Retention(MaxStreamAge, kafkaSegment))
		cl := kafkatest.GroupClient(b, brokers, kafkatest.Name("charges"), []string{topic})
		q := &kafkaBench{prod: prod, cl: cl, topic: topic, batch: v.batch}
		if eng == nil {
			q.next = func(ctx context.Context, n int) ([]*kgo.Record, error) {
				fs := cl.PollRecords(ctx, n)
				if err := fs.Err0(); err != nil {
					return nil, err
				}
				return fs.Records(), nil
			}
			q.handle = func(ctx context.Context, rs []*kgo.Record) error {
				if err := bareCharges(ctx, v, w, pool, len(rs), func(i int) ([]string, []byte) { return kafkaHeader(rs[i], "tenant"), rs[i].Value }); err != nil {
					return err
				}
				return cl.CommitRecords(ctx, rs...)
			}
			return q
		}
		kb, err := idemkafka.New(ctx, cl)
		if err != nil {
			b.Fatal(err)
		}
		c, err := newConsumer(eng, benchConfig, opts, w, kb,
			func(r *kgo.Record) (string, error) { return tenant(kafkaHeader(r, "tenant")) },
			func(r *kgo.Record) []byte { return r.Value },
		)
		if err != nil {
			b.Fatal(err)
		}
		q.next = func(ctx context.Context, n int) ([]*kgo.Record, error) {
			return idemkafka.NextBatch(ctx, cl, n, 5*time.Millisecond)
		}
		q.handle = func(ctx context.Context, rs []*kgo.Record) error {
			if len(rs) == 1 && v.batch == 1 {
				return benchProcessed(c.Handle(ctx, rs[0]))
			}
			for _, res := range c.HandleBatch(ctx, rs) {
				if err := benchProcessed(res); err != nil {
					return err
				}
			}
			return nil
		}
		return q
	}
}

func (q *kafkaBench) publish(ctx context.Context, n int) error {
	rs := make([]*kgo.Record, n)
	for i := range rs {
		rs[i] = &kgo.Record{Topic: q.topic, Value: benchBody, Headers: []kgo.RecordHeader{
			{Key: "message-id", Value: []byte(strconv.Itoa(q.sent))}, {Key: "tenant", Value: []byte("acme")}}}
		q.sent++
	}
	return q.prod.ProduceSync(ctx, rs...).FirstErr()
}

// consume runs one loop of polls, as the command does: it takes what the
// gate lets go, up to the variant's batch, and commits it before the next
// poll.
func (q *kafkaBench) consume(t testing.TB, g *benchGate) {
	g.handle = func(ctx context.Context, msgs []any) error {
		rs := make([]*kgo.Record, len(msgs))
		for i, m := range msgs {
			rs[i] = m.(*kgo.Record)
		}
		return q.handle(ctx, rs)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			n := g.take()
			if n == 0 {
				return
			}
			var msgs []any
			for len(msgs) < n {
				rs, err := q.next(ctx, n-len(msgs))
				if err != nil {
					return
				}
				for _, r := range rs {
					msgs = append(msgs, r)
				}
			}
			g.processed(context.Background(), msgs)
			q.cl.AllowRebalance()
		}
	})
	t.Cleanup(func() {
		g.stop()
		cancel()
		wg.Wait()
	})
}
