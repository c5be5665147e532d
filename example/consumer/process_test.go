package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"google.golang.org/protobuf/encoding/protojson"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/natstest"
)

// The command under test, built once per test binary (internal/servertest
// builds the example server the same way; its Start is the server's own,
// which waits for a listening address, so it is not reused here).
var built struct {
	sync.Once
	dir, bin string
	err      error
}

func consumerBinary(t testing.TB) string {
	t.Helper()
	built.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "idemkey-consumer."); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "consumer")
		args := []string{"build", "-o", built.bin}
		if raceEnabled {
			args = append(args, "-race")
		}
		out, err := exec.Command("go", append(args, "github.com/idemkey/idemkey/example/consumer")...).CombinedOutput()
		if err != nil {
			built.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.bin
}

func removeBinary() {
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
}

// proc is one running consumer process, whose standard error (its slog text
// lines) the test reads to wait on its states.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and its log is read

	mu    sync.Mutex
	lines []string
}

// start starts the consumer with args and waits until it consumes. It is
// killed, if still running, when t ends; its log is shown if t failed.
func start(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	p, err := launch(t, name, consumerBinary(t), args...)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, name+" consumes", func() bool {
		select {
		case <-p.done:
			t.Fatalf("%s exited before it consumed (%v):\n%s", name, p.cmd.ProcessState, p.log())
		default:
		}
		return p.count("msg=consuming") > 0
	})
	return p
}

// kill kills the process with SIGKILL, as a crash would, and waits until it
// is gone.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// stop stops the process with SIGTERM and fails t unless it exits cleanly.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not stop within 30s of SIGTERM", p.name)
	}
	if !p.cmd.ProcessState.Success() {
		t.Errorf("%s stopped with %v, want exit status 0", p.name, p.cmd.ProcessState)
	}
}

// count counts the log lines that hold every one of parts.
func (p *proc) count(parts ...string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, line := range p.lines {
		if containsAll(line, parts) {
			n++
		}
	}
	return n
}

func (p *proc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.lines, "\n")
}

func containsAll(s string, parts []string) bool {
	for _, part := range parts {
		if !strings.Contains(s, part) {
			return false
		}
	}
	return true
}

// countAll counts the lines of all of procs that hold every one of parts.
func countAll(procs []*proc, parts ...string) int {
	n := 0
	for _, p := range procs {
		n += p.count(parts...)
	}
	return n
}

// neverLogged fails t if any of procs logged one of secrets: the command
// logs no message's id, tenant or body.
func neverLogged(t *testing.T, procs []*proc, secrets ...string) {
	t.Helper()
	for _, p := range procs {
		log := p.log()
		for _, s := range secrets {
			if strings.Contains(log, s) {
				t.Errorf("%s logged %q, which a message held", p.name, s)
			}
		}
	}
}

// send publishes one message and waits until the broker has it.
func send(t *testing.T, b broker, id, tenant string, body []byte) {
	t.Helper()
	if err := b.publish(t.Context(), id, tenant, body); err != nil {
		t.Fatal(err)
	}
	if err := b.flush(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls cond until it holds, failing t after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting until %s", timeout, what)
		}
	}
}

// body is a charge request in protobuf JSON whose description names the
// message's number n: charges are counted per message by it.
func body(n int) []byte {
	b, err := protojson.Marshal(&paymentsv1.CreateChargeRequest{
		CustomerId:  "cus_consumer_test",
		Amount:      int64(100 + n),
		Currency:    "EUR",
		Description: description(n),
	})
	if err != nil {
		panic(err) // a message of this package's own
	}
	return b
}

func description(n int) string { return fmt.Sprintf("message %d", n) }

// charges counts the rows of the charges table, 0 before the consumer has
// created it.
func charges(t *testing.T, db *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM charges`).Scan(&n); err != nil {
		if strings.Contains(err.Error(), "42P01") { // undefined_table
			return 0
		}
		t.Fatalf("count charges: %v", err)
	}
	return n
}

// broker is NATS JetStream, RabbitMQ or Kafka, with a stream, queue or
// topic of the test's own.
type broker interface {
	// args are the consumer's flags for the test's stream or queue, and
	// extra ones that only this broker takes (JetStream's -ack-wait).
	args(ackWait string) []string
	// publish publishes a message with id (none if empty) and a tenant
	// header (none if empty). flush waits until the broker has every message
	// published so far. Both may run outside the test's goroutine.
	publish(ctx context.Context, id, tenant string, body []byte) error
	flush(ctx context.Context) error
	// settled fails t unless every message published is settled: JetStream
	// has none pending or unacknowledged (it waits while procs run), the
	// queue holds none once procs are stopped (it stops them).
	settled(t *testing.T, procs ...*proc)
	// ready counts the messages waiting for a consumer: they may be in
	// flight besides.
	ready(t *testing.T) int
}

// forEachBroker runs test for NATS JetStream, RabbitMQ and Kafka, in
// parallel.
func forEachBroker(t *testing.T, test func(t *testing.T, b func(*testing.T) broker)) {
	forBrokers(t, []string{"nats", "rabbitmq", "kafka"}, test)
}

// newBrokers make each broker of a test, by name.
var newBrokers = map[string]func(*testing.T) broker{
	"nats":     func(t *testing.T) broker { return newNATS(t, false) },
	"rabbitmq": func(t *testing.T) broker { return newRabbitMQ(t) },
	"kafka":    func(t *testing.T) broker { return newKafka(t) },
}

// forBrokers runs test for each of the brokers names, in parallel.
func forBrokers(t *testing.T, names []string, test func(t *testing.T, b func(*testing.T) broker)) {
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, newBrokers[name])
		})
	}
}

type natsBroker struct {
	js                     jetstream.JetStream
	stream, subject, durab string
}

// newNATS names a stream, subject and durable consumer of the test's own.
// With create the test creates the stream (with a duplicate window of 100ms,
// so that a message may be published again soon after); else the consumer
// does. Either way it is deleted when t ends.
func newNATS(t *testing.T, create bool) *natsBroker {
	t.Helper()
	_, js := natstest.Connect(t)
	b := &natsBroker{js: js, stream: natstest.Name("PAYMENTS"), durab: natstest.Name("charges")}
	b.subject = strings.ToLower(b.stream) + ".charges.requested"
	if create {
		natstest.Stream(t, js, jetstream.StreamConfig{
			Name: b.stream, Subjects: []string{b.subject}, MaxAge: MaxStreamAge, Duplicates: 100 * time.Millisecond,
		})
		return b
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, b.stream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) && !errors.Is(err, nats.ErrConnectionClosed) {
			t.Logf("delete stream: %v", err)
		}
	})
	return b
}

func (b *natsBroker) args(ackWait string) []string {
	args := []string{"-nats-url", natstest.URL(), "-stream", b.stream, "-subject", b.subject, "-name", b.durab}
	if ackWait != "" {
		args = append(args, "-ack-wait", ackWait)
	}
	return args
}

func (b *natsBroker) publish(ctx context.Context, id, tenant string, body []byte) error {
	msg := nats.NewMsg(b.subject)
	msg.Data = body
	if id != "" && tenant != "" {
		id = tenant + "/" + id // unique across tenants, as example/publish publishes it
	}
	if id != "" {
		msg.Header.Set(jetstream.MsgIDHeader, id)
	}
	if tenant != "" {
		msg.Header.Set("tenant", tenant)
	}
	// A message published again within the stream's duplicate window is
	// dropped by JetStream itself: publish it again once the window passed.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ack, err := b.js.PublishMsg(ctx, msg)
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		if !ack.Duplicate {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("JetStream kept dropping a message published again as a duplicate")
		}
	}
}

func (b *natsBroker) flush(context.Context) error { return nil } // PublishMsg waits for JetStream's ack

func (b *natsBroker) info(t *testing.T) *jetstream.ConsumerInfo {
	t.Helper()
	cons, err := b.js.Consumer(t.Context(), b.stream, b.durab)
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	info, err := cons.Info(t.Context())
	if err != nil {
		t.Fatalf("consumer info: %v", err)
	}
	return info
}

func (b *natsBroker) ready(t *testing.T) int {
	return int(b.info(t).NumPending)
}

func (b *natsBroker) settled(t *testing.T, procs ...*proc) {
	t.Helper()
	var info *jetstream.ConsumerInfo
	// Two minutes: a message whose run was killed, in two-phase mode, waits
	// for its lease (a minute) to end.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if info = b.info(t); info.NumPending == 0 && info.NumAckPending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 2m, JetStream still has %d messages pending and %d unacknowledged", info.NumPending, info.NumAckPending)
		}
	}
	for _, p := range procs {
		p.stop(t)
	}
}

type rabbitBroker struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	queue   string
	returns chan amqp.Return

	mu       sync.Mutex
	confirms []*amqp.DeferredConfirmation
}

// newRabbitMQ names a queue of the test's own, which the consumer declares,
// and deletes it when t ends.
func newRabbitMQ(t *testing.T) *rabbitBroker {
	t.Helper()
	conn := amqptest.Conn(t)
	b := &rabbitBroker{conn: conn, ch: amqptest.Channel(t, conn), queue: amqptest.Name("charges")}
	if err := b.ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	b.returns = b.ch.NotifyReturn(make(chan amqp.Return, 1))
	amqptest.DeleteQueueAtEnd(t, conn, b.queue) // the consumer declares it
	return b
}

func (b *rabbitBroker) args(string) []string {
	return []string{"-amqp-url", amqptest.URL(), "-queue", b.queue}
}

func (b *rabbitBroker) publish(ctx context.Context, id, tenant string, body []byte) error {
	p := amqp.Publishing{MessageId: id, Body: body, DeliveryMode: amqp.Persistent, ContentType: "application/json"}
	if tenant != "" {
		p.Headers = amqp.Table{"tenant": tenant}
	}
	// mandatory: a message no queue takes comes back rather than vanish (the
	// consumer declares the queue before it logs that it consumes).
	c, err := b.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, true, false, p)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	b.mu.Lock()
	b.confirms = append(b.confirms, c)
	b.mu.Unlock()
	return nil
}

func (b *rabbitBroker) flush(ctx context.Context) error {
	b.mu.Lock()
	confirms := b.confirms
	b.confirms = nil
	b.mu.Unlock()
	for _, c := range confirms {
		ok, err := c.WaitContext(ctx)
		if err != nil || !ok {
			return fmt.Errorf("RabbitMQ did not confirm a message: %v", err)
		}
	}
	select {
	case <-b.returns: // it came before its confirmation
		return errors.New("RabbitMQ returned a message: no queue took it")
	default:
		return nil
	}
}

func (b *rabbitBroker) ready(t *testing.T) int {
	t.Helper()
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(b.queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect queue: %v", err)
	}
	return q.Messages
}

// left waits until the queue has no consumer, which is when RabbitMQ has put
// back what they had in hand, and counts its messages.
func (b *rabbitBroker) left(t *testing.T) int {
	t.Helper()
	var q amqp.Queue
	waitFor(t, 10*time.Second, "the queue has no consumer", func() bool {
		ch, err := b.conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close()
		if q, err = ch.QueueDeclarePassive(b.queue, true, false, false, false, nil); err != nil {
			t.Fatalf("inspect queue: %v", err)
		}
		return q.Consumers == 0
	})
	return q.Messages
}

func (b *rabbitBroker) settled(t *testing.T, procs ...*proc) {
	t.Helper()
	waitFor(t, 30*time.Second, "the queue has no message ready", func() bool { return b.ready(t) == 0 })
	for _, p := range procs {
		p.stop(t)
	}
	amqptest.Empty(t, b.conn, b.queue)
}
