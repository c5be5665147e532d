package idemamqp_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemamqp"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/amqptest"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// backend is a store the consumer runs on, and the options it needs.
type backend struct {
	name string
	new  func(t *testing.T) (store.Store, []consumer.Option)
}

var backends = []backend{
	{"memory", func(t *testing.T) (store.Store, []consumer.Option) { return memory.New(), nil }},
	{"postgres", func(t *testing.T) (store.Store, []consumer.Option) {
		st, _ := postgresStore(t)
		return st, nil
	}},
	{"postgres-atomic", func(t *testing.T) (store.Store, []consumer.Option) {
		st, _ := postgresStore(t)
		return st, []consumer.Option{consumer.WithAtomic()}
	}},
}

// postgresStore returns a store on a schema of t's own, and its pool.
func postgresStore(t *testing.T) (*postgres.Store, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st, pool
}

// ttl is the x-message-ttl of the tests' queues: within the default
// retention.
const ttl = int64(60_000)

// fixture is one test's queue on the test broker, and what the test's
// consumers log. When the test ends, after the channels it opened are
// closed, the queue must be empty, and the logs must hold no message id,
// tenant or body the test made with secret.
type fixture struct {
	t       *testing.T
	conn    *amqp.Connection
	queue   string
	args    amqp.Table
	pub     *amqp.Channel
	logs    *logtest.Buffer
	secrets []string
}

func newFixture(t *testing.T, args amqp.Table) *fixture {
	t.Helper()
	if args == nil {
		args = amqp.Table{}
	}
	if _, ok := args["x-message-ttl"]; !ok {
		args["x-message-ttl"] = ttl
	}
	conn := amqptest.Conn(t)
	f := &fixture{t: t, conn: conn, queue: amqptest.Queue(t, conn, args), args: args}
	f.pub = amqptest.Channel(t, conn)
	if err := f.pub.Confirm(false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		amqptest.Empty(t, conn, f.queue)
		for _, s := range f.secrets {
			if f.logs != nil && strings.Contains(f.logs.String(), s) {
				t.Errorf("the logs hold a message's id, tenant or body:\n%s", f.logs)
				break
			}
		}
	})
	return f
}

// secret returns a unique string with prefix that must never be logged.
func (f *fixture) secret(prefix string) string {
	var b [6]byte
	rand.Read(b[:])
	s := prefix + "-" + hex.EncodeToString(b[:])
	f.secrets = append(f.secrets, s)
	return s
}

// publish publishes a message to queue (the fixture's, if empty) and waits
// for the broker's confirmation.
func (f *fixture) publish(queue string, p amqp.Publishing) {
	f.t.Helper()
	if queue == "" {
		queue = f.queue
	}
	conf, err := f.pub.PublishWithDeferredConfirmWithContext(f.t.Context(), "", queue, true, false, p)
	if err != nil {
		f.t.Fatal(err)
	}
	if ok, err := conf.WaitContext(f.t.Context()); !ok || err != nil {
		f.t.Fatalf("publish not confirmed: %v", err)
	}
}

// consumer returns a consumer of the fixture's queue on st, with fast
// backoffs, no dead-letter hook (the tests that read dead letters give one
// in opts), copts and opts, on an engine with the retention consumers are
// given and the fixture's logger.
func (f *fixture) consumer(st store.Store, copts []consumer.Option, h func(context.Context, amqp.Delivery) error, opts ...consumer.Option) *consumer.Consumer[amqp.Delivery] {
	f.t.Helper()
	return f.consumerWith(st, nil, copts, h, opts...)
}

// consumerWith is consumer, on an engine with eopts.
func (f *fixture) consumerWith(st store.Store, eopts []engine.Option, copts []consumer.Option, h func(context.Context, amqp.Delivery) error, opts ...consumer.Option) *consumer.Consumer[amqp.Delivery] {
	f.t.Helper()
	logger, logs := logtest.New()
	f.logs = logs
	eng, err := engine.New(st, append([]engine.Option{engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(logger)}, eopts...)...)
	if err != nil {
		f.t.Fatal(err)
	}
	b, err := idemamqp.New(f.queue, f.args)
	if err != nil {
		f.t.Fatal(err)
	}
	all := append([]consumer.Option{
		consumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond),
		consumer.WithDiscardDeadLetters(), // the tests that read dead letters set a hook
	}, copts...)
	c, err := consumer.New(eng, "billing", b, h, append(all, opts...)...)
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}

// consume starts a consumer of queue (the fixture's, if empty) on a channel
// of its own with prefetch, closed when the test ends.
func (f *fixture) consume(queue string, prefetch int) (*amqp.Channel, <-chan amqp.Delivery) {
	f.t.Helper()
	if queue == "" {
		queue = f.queue
	}
	ch := amqptest.Channel(f.t, f.conn)
	if err := ch.Qos(prefetch, 0, false); err != nil {
		f.t.Fatal(err)
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	return ch, ds
}

// next returns the next delivery of ds.
func next(t *testing.T, ds <-chan amqp.Delivery) amqp.Delivery {
	t.Helper()
	select {
	case d, ok := <-ds:
		if !ok {
			t.Fatal("the consumer's channel closed")
		}
		return d
	case <-time.After(5 * time.Second):
		t.Fatal("no delivery within 5s")
	}
	return amqp.Delivery{}
}

// handle runs c.Handle and checks its outcome and action, and that a
// negative acknowledgement waited for its delay: at most a second for a
// message in progress elsewhere, on a queue without a delivery limit.
func handle(t *testing.T, c *consumer.Consumer[amqp.Delivery], d amqp.Delivery, want consumer.Outcome, action consumer.Action) consumer.Result {
	t.Helper()
	start := time.Now()
	res := c.Handle(t.Context(), d)
	if res.Outcome != want || res.Action != action {
		t.Fatalf("Handle = %v (err %v); want %v (%v)", res, res.Err, want, action)
	}
	delay := res.Delay
	if res.Outcome == consumer.Busy {
		delay = min(delay, time.Second)
	}
	if took := time.Since(start); res.Action == consumer.Nak && took < delay {
		t.Errorf("Handle took %v to negative-acknowledge; want at least the delay, %v", took, delay)
	}
	return res
}

var errHook = errors.New("the dead-letter exchange is down")

// hook is a dead-letter hook that records the errors it is given, and fails
// while fail is above zero.
type hook struct {
	errs []error
	fail int
}

func (h *hook) deadLetter(_ context.Context, _ amqp.Delivery, err error) error {
	h.errs = append(h.errs, err)
	if h.fail > 0 {
		h.fail--
		return errHook
	}
	return nil
}
