// Command consumer makes charges from charge requests that arrive as
// messages, with the payment service's own code and ledger, each at most once
// per message id: from NATS JetStream with -nats-url, from RabbitMQ with
// -amqp-url, or from Kafka with -kafka-brokers.
//
//	go run ./example/consumer -nats-url nats://127.0.0.1:4222 -database-url postgres://postgres@127.0.0.1:5432/test
//	go run ./example/consumer -amqp-url amqp://guest:guest@127.0.0.1:5672/ -database-url postgres://postgres@127.0.0.1:5432/test
//	go run ./example/consumer -kafka-brokers 127.0.0.1:9092 -database-url postgres://postgres@127.0.0.1:5432/test
//
// A message's body is a CreateChargeRequest in protobuf JSON; its header
// "tenant" names the tenant (acme or globex); its id is the message's own:
// JetStream's Nats-Msg-Id header, which must be unique across tenants (the
// tenant in it, as example/publish does: JetStream drops a message whose
// Nats-Msg-Id it stored within the stream's duplicate window, whichever the
// tenant), AMQP's message-id property, or a Kafka record's message-id
// header. It consumes
// from the stream PAYMENTS (subject payments.charges.requested) through the
// durable consumer "charges", from the quorum queue
// payments.charges.requested, or from the Kafka topic
// payments.charges.requested in the group "charges", and creates them when
// missing, with messages kept at most three days (MaxStreamAge; a Kafka
// topic's segments take records for a day more), well within the seven days
// that processed ids are kept.
//
// On PostgreSQL (-database-url) each charge commits with the message's
// record (-atomic, the default): every message takes effect exactly once,
// however the consumer dies. Without a database, both live in memory, for
// trying it out. It logs one line per message with its outcome, never its
// id, tenant or body.
//
// With -batch N it takes up to N messages at once (JetStream: one loop over
// a Messages iterator; RabbitMQ: each of -workers takes a batch, on a
// prefetch of N per worker; Kafka: one loop over polls of up to N records),
// waiting at most -batch-wait after the first for
// the others (Kafka: a batch is what a poll returns); in atomic mode a batch is deduplicated in one round trip and
// its charges commit with their records in one transaction, each message
// apart (consumer.Consumer.HandleBatch), and its messages are acknowledged
// after that commit.
//
// With -processor-url each charge is first made at that card processor
// (example/processor) as the recorded step "charge-card", the payment
// service's own, and the processor's id is kept with the charge: a message
// redelivered after a crash between the processor's charge and the write
// gets the step's result rather than charge again. A step an earlier
// delivery left started (the processor's answer was lost) is looked up at
// the processor by its key; with -reconcile=false, or when the processor
// cannot tell, its outcome is unknown: the message is held, redelivered with
// backoff, and dead-lettered on its last delivery, never acknowledged unrun.
//
// With -receipts it consumes what the server run with -outbox announces,
// payments.charge.created (example.ChargeCreated in JSON, the header
// "tenant"; the subject, queue or topic unless -subject, -queue or -topic
// says otherwise, as consumer "receipts" unless -name does, from the stream
// that takes the subject, made if none does), and writes one receipt per
// charge in the table receipts of -database-url, which it needs: in atomic
// mode with the message's record, so that a redelivery, or the relay's
// resend of a message, is dropped and never makes a second receipt. The
// table's unique constraint on the charge is a second line of defence that
// counts what it catches (the column duplicates) rather than hide it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/idemnats"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// MaxStreamAge is how long the stream or queue this command creates keeps a
// message: JetStream's max age, RabbitMQ's x-message-ttl. It bounds how late
// a message may be redelivered, which must be sooner than its record expires
// (consumer.RecommendedRetention, the engine's retention here).
const MaxStreamAge = 72 * time.Hour

// config is what the flags set.
type config struct {
	natsURL, amqpURL, databaseURL string
	redisURL                      string        // the processed ids in Redis, two-phase
	kafkaBrokers                  string        // comma-separated seed brokers
	kafkaSessionTimeout           time.Duration // how soon the group gives a dead member's partitions to another
	atomic                        bool
	handlerDelay, ackDelay        time.Duration
	handlerTimeout                time.Duration // and so the lease: how soon a killed run's message runs again
	ackWait                       time.Duration // JetStream's, for a consumer this command creates
	name                          string        // the consumer's, which scopes message ids
	stream, subject, queue, topic string
	workers                       int
	batch                         int           // messages taken and committed together; 1: one at a time
	batchWait                     time.Duration // how long a batch waits to fill, after its first message
	maxDeliver                    int           // JetStream's max deliver, RabbitMQ's x-delivery-limit, Kafka's attempts; 0: the defaults
	backoff, maxBackoff           time.Duration // consumer.WithBackoff's; 0: its defaults
	processorURL                  string        // the card processor's; empty charges none
	processorTimeout              time.Duration // bounds each call to the processor
	reconcile                     bool          // look up a charge an earlier delivery started
	receipts                      bool          // consume payments.charge.created, and write receipts
}

func main() {
	var cfg config
	flag.StringVar(&cfg.natsURL, "nats-url", "", "consume from NATS JetStream at this URL")
	flag.StringVar(&cfg.amqpURL, "amqp-url", "", "consume from RabbitMQ at this URL")
	flag.StringVar(&cfg.kafkaBrokers, "kafka-brokers", "", "consume from Kafka with these seed brokers (host:port, comma-separated)")
	flag.DurationVar(&cfg.kafkaSessionTimeout, "kafka-session-timeout", 45*time.Second, "Kafka: the group session timeout, after which a member that died loses its partitions")
	flag.StringVar(&cfg.databaseURL, "database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL for the processed ids and the charges; empty keeps both in memory")
	flag.StringVar(&cfg.redisURL, "redis-url", "", "Redis URL (redis://host:port/db) for the processed ids, two-phase; the charges stay in -database-url, or in memory")
	flag.IntVar(&cfg.maxDeliver, "max-deliver", 0, "how often a message is delivered before its last delivery dead-letters a failure: JetStream's max deliver and RabbitMQ's x-delivery-limit, for a consumer or queue this command creates, and Kafka's attempts; 0: the brokers' defaults (none; none; 5)")
	flag.DurationVar(&cfg.backoff, "backoff", 0, "the delay before a message that failed for now is redelivered, doubling with each delivery; 0: 1s")
	flag.DurationVar(&cfg.maxBackoff, "max-backoff", 0, "the longest such delay; 0: 1m")
	flag.BoolVar(&cfg.atomic, "atomic", true, "on PostgreSQL, commit each charge with its message's record in one transaction; false runs two-phase")
	flag.DurationVar(&cfg.handlerDelay, "handler-delay", 0, "how long a charge waits after it is written, before it commits (atomic) and its message is acknowledged; with -processor-url, after the processor's answer and before the charge is written")
	flag.DurationVar(&cfg.ackDelay, "ack-delay", 0, "how long a processed message waits after its record committed, before it is acknowledged")
	flag.DurationVar(&cfg.handlerTimeout, "handler-timeout", 0, "bounds each charge; a message whose consumer died runs again this long (plus 5s) after it started, in two-phase mode; 0: no bound, and a minute")
	flag.DurationVar(&cfg.ackWait, "ack-wait", 30*time.Second, "JetStream: the ack wait of the durable consumer, if this command creates it")
	flag.StringVar(&cfg.name, "name", "charges", "the consumer's name, which scopes message ids; JetStream's durable consumer")
	flag.StringVar(&cfg.stream, "stream", "PAYMENTS", "JetStream: the stream")
	flag.StringVar(&cfg.subject, "subject", "payments.charges.requested", "JetStream: the subject")
	flag.StringVar(&cfg.queue, "queue", "payments.charges.requested", "RabbitMQ: the queue")
	flag.StringVar(&cfg.topic, "topic", "payments.charges.requested", "Kafka: the topic, consumed in the group named by -name")
	flag.IntVar(&cfg.workers, "workers", 4, "RabbitMQ: messages processed at once (and the prefetch), or with -batch, batches (and the database pool holds at least one more connection than workers)")
	flag.IntVar(&cfg.batch, "batch", 1, "take up to this many messages at once and, in atomic mode, process them in one transaction that commits once (64 at most in one); 1 processes one at a time")
	flag.DurationVar(&cfg.batchWait, "batch-wait", 5*time.Millisecond, "with -batch: how long a batch waits for more messages after its first, before it runs with those it has")
	flag.StringVar(&cfg.processorURL, "processor-url", "", "charge each message at this card processor's base URL first, as a recorded step; empty charges no processor")
	flag.DurationVar(&cfg.processorTimeout, "processor-timeout", 5*time.Second, "with -processor-url: how long a call to the processor may take")
	flag.BoolVar(&cfg.reconcile, "reconcile", true, "with -processor-url: look up at the processor a charge an earlier delivery started and never finished; false holds the message as outcome unknown, and dead-letters it on its last delivery")
	flag.BoolVar(&cfg.receipts, "receipts", false, "consume the server's payments.charge.created (its -outbox) rather than charge requests, and write one receipt per charge in the database; -subject, -queue, -topic default to payments.charge.created, -name to receipts, and -stream to the stream of the subject")
	var level slog.Level
	flag.TextVar(&level, "log-level", slog.LevelInfo, "the least level logged: debug, info, warn or error")
	flag.Parse()
	if cfg.receipts {
		set := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
		receiptDefaults(&cfg, set)
	}

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, logger); err != nil {
		logger.Error("consumer stopped", "error", err)
		os.Exit(1)
	}
}

// run consumes until ctx is done, then lets the messages in hand finish.
func run(ctx context.Context, cfg config, logger *slog.Logger) error {
	if n := countSet(cfg.natsURL, cfg.amqpURL, cfg.kafkaBrokers); n != 1 {
		return errors.New("give one of -nats-url, -amqp-url and -kafka-brokers")
	}
	if cfg.batch < 1 {
		return errors.New("-batch must be at least 1")
	}
	if cfg.receipts && cfg.databaseURL == "" {
		return errors.New("-receipts writes the receipts in PostgreSQL: it needs a database URL")
	}
	if cfg.processorURL != "" && cfg.processorTimeout <= 0 {
		return fmt.Errorf("-processor-timeout %v: a call to the processor needs a positive time", cfg.processorTimeout)
	}
	var (
		st     store.Store    = memory.New()
		ledger example.Ledger = example.NewMemoryLedger()
		rs     *receipts      // with -receipts
	)
	if cfg.databaseURL == "" || cfg.redisURL != "" {
		cfg.atomic = false // atomic mode needs the ids and the charges in one database
	}
	if cfg.databaseURL != "" {
		// A batch holds a transaction for its whole run: with -batch, each
		// of RabbitMQ's workers has one, and a connection is left for the
		// reads of the ones waiting.
		transactions := 0 // the store's default
		if cfg.batch > 1 && cfg.amqpURL != "" {
			transactions = max(cfg.workers, 1)
		}
		pool, err := example.OpenDatabase(ctx, cfg.databaseURL, true, logger, func(c *pgxpool.Config) {
			c.MaxConns = max(c.MaxConns, int32(transactions+1))
		})
		if err != nil {
			return err
		}
		defer pool.Close()
		pst, err := postgres.New(pool, postgres.WithLogger(logger), postgres.WithAtomicConns(transactions))
		if err != nil {
			return err
		}
		st, ledger = pst, example.NewPostgresLedger(pool)
		if cfg.receipts {
			if rs, err = newReceipts(ctx, pool); err != nil {
				return err
			}
		}
		// Expired records are deleted, as the server deletes them: without
		// it, every message id ever processed would stay in the table.
		defer example.Background(ctx, (&store.Janitor{Store: pst, Logger: logger}).Run)()
	}
	if cfg.redisURL != "" {
		rst, closeRedis, err := example.OpenRedis(ctx, cfg.redisURL, "", logger)
		if err != nil {
			return err
		}
		defer closeRedis()
		st = rst
	}
	system := "nats"
	switch {
	case cfg.amqpURL != "":
		system = "rabbitmq"
	case cfg.kafkaBrokers != "":
		system = "kafka"
	}
	// A message's id is kept for days, past every redelivery of it:
	// consumer.New checks the retention against the broker's horizon.
	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(logger))
	if err != nil {
		return err
	}
	// The consumer's options that know no broker; each consume function adds
	// those of its broker's messages (their tenant, their dead letters).
	opts := []consumer.Option{consumer.WithHandlerTimeout(cfg.handlerTimeout), consumer.WithBackoff(cfg.backoff, cfg.maxBackoff)}
	if cfg.atomic {
		opts = append(opts, consumer.WithAtomic())
	}
	// The payment service's own CreateCharge, and its processor's step.
	svc, err := example.NewServiceFromConfig(example.Config{Ledger: ledger, HandlerDelay: cfg.handlerDelay,
		ProcessorURL: cfg.processorURL, ProcessorTimeout: cfg.processorTimeout, WithoutReconcile: !cfg.reconcile})
	if err != nil {
		return err
	}
	w := &worker{svc: svc, receipts: rs, ackDelay: cfg.ackDelay, logger: logger}
	mode := "two-phase"
	if cfg.atomic {
		mode = "atomic"
	}
	attrs := []any{"broker", system, "store", storeKind(cfg), "mode", mode}
	if cfg.receipts {
		attrs = append(attrs, "receipts", true)
	}
	if cfg.batch > 1 {
		attrs = append(attrs, "batch", cfg.batch)
	}
	if cfg.processorURL != "" {
		attrs = append(attrs, "processor", true, "reconcile", cfg.reconcile)
	}
	logger.Info("consumer starting", append(attrs, "handler_delay", cfg.handlerDelay, "ack_delay", cfg.ackDelay)...)
	switch {
	case cfg.natsURL != "":
		return consumeNATS(ctx, cfg, eng, opts, w)
	case cfg.kafkaBrokers != "":
		return consumeKafka(ctx, cfg, eng, opts, w)
	}
	return consumeAMQP(ctx, cfg, eng, opts, w)
}

// stopGrace is how long a stop lets the messages in hand finish: one that
// takes longer, such as a last delivery held while the store fails, is then
// cut short and negative-acknowledged, rather than hold the stop for ever.
const stopGrace = 10 * time.Second

// workContext is the context messages are processed on: it ends stopGrace
// after ctx does, so that a stop lets the message in hand finish its store
// calls rather than cut them short.
func workContext(ctx context.Context) (context.Context, context.CancelFunc) {
	work, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(stopGrace, cancel) })
	return work, func() { stop(); cancel() }
}

// countSet counts the values that are not empty.
func countSet(values ...string) int {
	n := 0
	for _, v := range values {
		if v != "" {
			n++
		}
	}
	return n
}

func storeKind(cfg config) string {
	if cfg.redisURL != "" {
		return "redis"
	}
	if cfg.databaseURL == "" {
		return "memory"
	}
	return "postgres"
}

// worker is what the brokers' consumers share: the charge a message asks
// for, and what is done with its outcome.
type worker struct {
	svc      *example.Service
	receipts *receipts // with -receipts: messages are charges to write a receipt of
	ackDelay time.Duration
	logger   *slog.Logger
}

// charge makes the charge body asks for, for tenant; with -receipts, it
// writes the receipt of the charge body announces.
func (w *worker) charge(ctx context.Context, tenant string, body []byte) error {
	if w.receipts != nil {
		return w.receipts.write(ctx, tenant, body)
	}
	req := new(paymentsv1.CreateChargeRequest)
	if err := protojson.Unmarshal(body, req); err != nil {
		// Final: no redelivery can parse it (InvalidArgument alone releases,
		// as over gRPC, and would be redelivered).
		return consumer.Final(status.Error(codes.InvalidArgument, "the body is not a CreateChargeRequest in protobuf JSON"))
	}
	_, err := w.svc.CreateCharge(example.ContextWithTenant(ctx, tenant), req)
	return err
}

// tenant reads the tenant header's one value: acme or globex.
func tenant(values []string) (string, error) {
	if len(values) == 1 && (values[0] == "acme" || values[0] == "globex") {
		return values[0], nil
	}
	return "", errors.New("the tenant header is missing, repeated, or names no tenant")
}

// newConsumer is the consumer named -name of b's messages, on eng with
// opts: it charges the tenant and the body that tenantOf and body read
// from a message, and keeps its dead letters in the log. A message whose
// tenant tenantOf refuses is refused without a charge.
func newConsumer[M any](eng *engine.Engine, cfg config, opts []consumer.Option, w *worker, b consumer.Broker[M],
	tenantOf func(M) (string, error), body func(M) []byte, more ...consumer.Option,
) (*consumer.Consumer[M], error) {
	opts = append(slices.Clip(opts), more...)
	opts = append(opts,
		consumer.WithMessageTenant(tenantOf),
		consumer.WithDeadLetter(func(_ context.Context, _ M, err error) error { return w.deadLetter(err) }))
	return consumer.New(eng, cfg.name, delayAcks(b, w.ackDelay),
		func(ctx context.Context, m M) error {
			t, _ := tenantOf(m) // checked by WithMessageTenant
			return w.charge(ctx, t, body(m))
		}, opts...)
}

// delayAcks is b, unless delay is positive: then b, whose Settle first
// waits delay if a message it settles was processed, so that a test can
// kill the command after a charge committed and before its message is
// acknowledged (-ack-delay). It keeps b's optional methods (see
// consumer.Broker).
func delayAcks[M any](b consumer.Broker[M], delay time.Duration) consumer.Broker[M] {
	if delay <= 0 {
		return b
	}
	d := ackDelayed[M]{Broker: b, delay: delay}
	attempts, retries := b.(maxAttempter)
	tenants, checks := b.(tenantChecker)
	switch {
	case retries && checks:
		return struct {
			ackDelayed[M]
			maxAttempter
			tenantChecker
		}{d, attempts, tenants}
	case retries:
		return struct {
			ackDelayed[M]
			maxAttempter
		}{d, attempts}
	case checks:
		return struct {
			ackDelayed[M]
			tenantChecker
		}{d, tenants}
	}
	return d
}

// The optional methods of a consumer.Broker.
type (
	maxAttempter  interface{ MaxAttempts() int }
	tenantChecker interface{ CheckTenantIDs(id any) error }
)

// ackDelayed is a Broker whose Settle waits delay first, once, when a
// message it settles was processed.
type ackDelayed[M any] struct {
	consumer.Broker[M]
	delay time.Duration
}

func (b ackDelayed[M]) Settle(ctx context.Context, ms []M, results []consumer.Result) error {
	if slices.ContainsFunc(results, func(res consumer.Result) bool { return res.Outcome == consumer.Processed && res.Action == consumer.Ack }) {
		time.Sleep(b.delay)
	}
	return b.Broker.Settle(ctx, ms, results)
}

// log logs one line of a message's outcome: where it was in the stream or
// queue, and why it failed or was refused, but never its id, tenant or body.
func (w *worker) log(res consumer.Result, where ...any) {
	attrs := append([]any{"outcome", res.Outcome.String(), "action", res.Action.String()}, where...)
	if res.Action == consumer.Nak {
		attrs = append(attrs, "delay", res.Delay.Round(time.Millisecond))
	}
	if res.Err != nil {
		attrs = append(attrs, why(res.Err))
	}
	w.logger.Info("message", attrs...)
}

// why is a log attribute that says why a message failed or was refused: the
// code of the service's gRPC status (whose messages hold no request data), or
// else the words of idemkey's or this command's refusal.
func why(err error) slog.Attr {
	if s, ok := status.FromError(err); ok {
		return slog.String("code", s.Code().String())
	}
	return slog.String("reason", err.Error())
}

// deadLetter stands in for a dead-letter destination, which a real
// consumer keeps (a subject, a queue, a table): it logs why, and that log
// line is the dead letter.
func (w *worker) deadLetter(err error) error {
	w.logger.Warn("dead letter, kept in this log only: the message failed for good, was refused, or ran out of deliveries", why(err))
	return nil
}

// consumeNATS consumes the JetStream stream until ctx is done.
func consumeNATS(ctx context.Context, cfg config, eng *engine.Engine, opts []consumer.Option, w *worker) error {
	nc, err := nats.Connect(cfg.natsURL, nats.Name("idemkey example consumer"), nats.MaxReconnects(-1))
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	if cfg.stream == "" { // -receipts: the stream of the subject, which the server's relay may have made
		if cfg.stream, err = js.StreamNameBySubject(ctx, cfg.subject); errors.Is(err, jetstream.ErrStreamNotFound) {
			cfg.stream, err = streamName(cfg.subject), nil
		}
		if err != nil {
			return fmt.Errorf("nats: stream of %s: %w", cfg.subject, err)
		}
	}
	stream, err := js.Stream(ctx, cfg.stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		stream, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: cfg.stream, Subjects: []string{cfg.subject}, MaxAge: MaxStreamAge})
	}
	if err != nil {
		return fmt.Errorf("nats: stream %s: %w", cfg.stream, err)
	}
	cons, err := stream.Consumer(ctx, cfg.name)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		cons, err = stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			Durable: cfg.name, FilterSubject: cfg.subject, AckPolicy: jetstream.AckExplicitPolicy, AckWait: cfg.ackWait,
			MaxDeliver: cfg.maxDeliver, // 0: JetStream's default, none
		})
	}
	if err != nil {
		return fmt.Errorf("nats: consumer %s: %w", cfg.name, err)
	}
	b, err := idemnats.New(ctx, stream, cons)
	if err != nil {
		return err
	}
	c, err := newConsumer(eng, cfg, opts, w, b,
		func(msg jetstream.Msg) (string, error) { return tenant(msg.Headers().Values("tenant")) },
		jetstream.Msg.Data,
		consumer.WithMessageID(idemnats.UniqueMessageID), // the producers put the tenant in the Nats-Msg-Id
	)
	if err != nil {
		return err
	}
	if cfg.batch > 1 {
		return consumeNATSBatches(ctx, cfg, cons, c, w)
	}
	// Messages are processed on a context of their own: a stop lets the one
	// in hand finish rather than cut its store calls short.
	work, endWork := workContext(ctx)
	defer endWork()
	cc, err := cons.Consume(func(msg jetstream.Msg) {
		w.log(c.Handle(work, msg), streamPlace(msg)...)
	})
	if err != nil {
		return fmt.Errorf("nats: consume: %w", err)
	}
	w.logger.Info("consuming", "stream", cfg.stream, "consumer", cfg.name)
	<-ctx.Done()
	w.logger.Info("shutting down")
	cc.Stop()
	<-cc.Closed()
	return nil
}

// consumeNATSBatches consumes the JetStream stream in batches of up to
// -batch messages, one batch at a time, until ctx is done. JetStream pulls
// up to two batches ahead, so that the next batch is there when one ends.
func consumeNATSBatches(ctx context.Context, cfg config, cons jetstream.Consumer, c *consumer.Consumer[jetstream.Msg], w *worker) error {
	it, err := cons.Messages(jetstream.PullMaxMessages(2 * cfg.batch))
	if err != nil {
		return fmt.Errorf("nats: messages: %w", err)
	}
	defer it.Stop()
	w.logger.Info("consuming", "stream", cfg.stream, "consumer", cfg.name, "batch", cfg.batch)
	// As in consumeNATS: a stop lets the batch in hand finish.
	work, endWork := workContext(ctx)
	defer endWork()
	for {
		msgs, err := idemnats.NextBatch(ctx, it, cfg.batch, cfg.batchWait)
		if ctx.Err() != nil {
			w.logger.Info("shutting down")
			return nil
		}
		if err != nil {
			return fmt.Errorf("nats: messages: %w", err)
		}
		for i, res := range c.HandleBatch(work, msgs) {
			w.log(res, streamPlace(msgs[i])...)
		}
	}
}

// streamPlace is where msg is in the stream, for its log line: its
// sequence, and how many times it was delivered, this time included.
func streamPlace(msg jetstream.Msg) []any {
	if meta, err := msg.Metadata(); err == nil {
		return []any{"stream_seq", meta.Sequence.Stream, "delivered", meta.NumDelivered}
	}
	return []any{"stream_seq", 0}
}

// consumeAMQP consumes the RabbitMQ queue until ctx is done, connecting
// again, a second later, whenever the connection is lost.
func consumeAMQP(ctx context.Context, cfg config, eng *engine.Engine, opts []consumer.Option, w *worker) error {
	args := amqp.Table{"x-queue-type": "quorum", "x-message-ttl": MaxStreamAge.Milliseconds()}
	if cfg.maxDeliver > 0 {
		args["x-delivery-limit"] = cfg.maxDeliver
	}
	qb, err := idemamqp.New(cfg.queue, args)
	if err != nil {
		return err
	}
	b := &connBroker{Broker: qb, conn: ctx}
	c, err := newConsumer(eng, cfg, opts, w, consumer.Broker[amqp.Delivery](b),
		func(d amqp.Delivery) (string, error) { return tenant(headerValues(d.Headers, "tenant")) },
		func(d amqp.Delivery) []byte { return d.Body },
	)
	if err != nil {
		return err
	}
	for {
		err := consumeAMQPOnce(ctx, cfg, args, c, b, w)
		if ctx.Err() != nil {
			return nil
		}
		w.logger.Warn("rabbitmq connection lost; connecting again", "error", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// consumeAMQPOnce consumes over one connection, until ctx is done or the
// connection is lost.
func consumeAMQPOnce(ctx context.Context, cfg config, args amqp.Table, c *consumer.Consumer[amqp.Delivery], b *connBroker, w *worker) error {
	conn, err := amqp.DialConfig(cfg.amqpURL, amqp.Config{
		Heartbeat: 10 * time.Second, Locale: "en_US", // amqp.Dial's
		Properties: amqp.Table{"connection_name": "idemkey example consumer of " + cfg.queue},
	})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(cfg.queue, true, false, false, false, args); err != nil {
		return fmt.Errorf("queue %s: %w", cfg.queue, err)
	}
	// Each worker may hold a batch.
	if err := ch.Qos(cfg.workers*cfg.batch, 0, false); err != nil {
		return err
	}
	// What ends this connection's consumption: the connection or the
	// channel closing, or the broker cancelling the consumer (its queue was
	// deleted, say). Registered before anything can end it.
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	cancelled := ch.NotifyCancel(make(chan string, 1))
	tag := fmt.Sprintf("idemkey-example-consumer-%d", os.Getpid())
	deliveries, err := ch.Consume(cfg.queue, tag, false, false, false, false, nil)
	if err != nil {
		return err
	}
	if cfg.batch > 1 {
		w.logger.Info("consuming", "queue", cfg.queue, "workers", cfg.workers, "batch", cfg.batch)
	} else {
		w.logger.Info("consuming", "queue", cfg.queue, "workers", cfg.workers)
	}
	// Messages are processed on a context of their own: a stop lets the ones
	// in hand finish rather than cut their store calls short. Their
	// acknowledgements end with this connection: a message waiting out its
	// delay is then requeued at once (by the broker, if the channel is gone).
	work, endWork := workContext(ctx)
	defer endWork()
	settleCtx, endSettles := context.WithCancel(ctx)
	defer endSettles()
	b.setConn(settleCtx)
	var wg sync.WaitGroup
	for range max(cfg.workers, 1) {
		if cfg.batch > 1 {
			wg.Go(func() {
				// NextBatch ends when the consumer is cancelled and its
				// deliveries closed.
				for ds := idemamqp.NextBatch(work, deliveries, cfg.batch, cfg.batchWait); ds != nil; ds = idemamqp.NextBatch(work, deliveries, cfg.batch, cfg.batchWait) {
					for i, res := range c.HandleBatch(work, ds) {
						w.log(res, "delivery_tag", ds[i].DeliveryTag, "redelivered", ds[i].Redelivered)
					}
				}
			})
			continue
		}
		wg.Go(func() {
			for d := range deliveries {
				w.log(c.Handle(work, d), "delivery_tag", d.DeliveryTag, "redelivered", d.Redelivered)
			}
		})
	}
	var ended error
	select {
	case <-ctx.Done():
		w.logger.Info("shutting down")
		ch.Cancel(tag, false)
		wg.Wait()
		return nil
	case err := <-connClosed:
		ended = closeError(err, "the connection was closed")
	case err := <-chClosed:
		ended = closeError(err, "the channel was closed")
	case <-cancelled:
		ended = errors.New("the broker cancelled the consumer: was its queue deleted?")
	}
	endSettles()
	wg.Wait()
	return ended
}

// connBroker is a queue's Broker whose settling ends with the connection
// its deliveries came over, as well as with its context: a message held
// for its delay before it is requeued (idemamqp's Settle) is then requeued
// by the broker at once, and the worker is free to connect again, while
// the messages in hand still finish their store calls on theirs.
type connBroker struct {
	consumer.Broker[amqp.Delivery]
	mu   sync.Mutex
	conn context.Context // the current connection's settling
}

// setConn sets the current connection's context; its workers have ended
// when the next one is set.
func (b *connBroker) setConn(ctx context.Context) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.conn = ctx
}

func (b *connBroker) Settle(ctx context.Context, ds []amqp.Delivery, results []consumer.Result) error {
	b.mu.Lock()
	conn := b.conn
	b.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(conn, cancel)()
	return b.Broker.Settle(ctx, ds, results)
}

// closeError is err, or a plain error with msg when the close was clean.
func closeError(err *amqp.Error, msg string) error {
	if err == nil {
		return errors.New(msg)
	}
	return err
}

// headerValues returns the values of an AMQP header that holds a string.
func headerValues(h amqp.Table, name string) []string {
	if v, ok := h[name].(string); ok {
		return []string{v}
	}
	return nil
}
