package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/amqptest"
	"github.com/idemkey/idemkey/tests/kafkatest"
	"github.com/idemkey/idemkey/tests/natstest"
)

var (
	outboxCharges = flag.Int("outbox-charges", 100, "charges TestOutboxKilled makes on each broker (make outbox-soak, the issue's run: 1000)")
	outboxKills   = flag.Int("outbox-kills", 1, "the fewest times TestOutboxKilled kills each part (make outbox-soak: 3)")
)

// From a key to a receipt, on each broker, black-box: a client makes
// charges over gRPC with retries, each under a key of its own, from the
// example server in atomic mode with -outbox, whose relay runs in the
// server and in a second process (-relay-only); the example consumer with
// -receipts writes a receipt per charge. Meanwhile the server, the relay,
// the consumer and, on NATS (a nats-server of the test's own, restarted on
// its store), the broker are each killed with SIGKILL at random times and
// restarted. The shared RabbitMQ, which other tests use, is not killed, nor
// Kafka, which is kfake in this test's process. Each server process fails
// its first 3 calls after the charge's write (-fail-after-write), whose
// charge and message roll back. The kills go on until the client is done
// and each was killed at least -outbox-kills times (1 in make test, where
// each kill of a Kafka consumer costs kfake's group a rebalance; 3 in make
// outbox-soak).
//
// Then every charge has exactly one receipt and every receipt one charge,
// every message announces a charge that exists (none of a rolled-back
// one), none is lost, and no receipt was written twice (the receipts'
// unique constraint counted no double). It logs how many messages the
// relays claimed more than once, how many reached the consumer more than
// once, and how they were dropped.
func TestOutboxKilled(t *testing.T) {
	for _, name := range []string{"nats", "rabbitmq", "kafka"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testOutboxKilled(t, name)
		})
	}
}

// outboxBroker is a broker for the test: its -outbox URL and destination,
// the consumer's flags, and how to kill and restart it (nil: it is not).
type outboxBroker struct {
	url, destination string
	consumerArgs     []string
	kill, restart    func()
	// spareConsumer leaves the consumer unkilled: on kfake, a group whose
	// members were killed was seen to hold its partitions for minutes,
	// twice past the test's six of waiting, so make test kills Kafka's
	// consumer only with -outbox-kills above 1 (make outbox-soak).
	spareConsumer bool
	// records counts what the broker took, resends included (Kafka), or
	// kept, resends dropped (JetStream); -1 if it cannot tell.
	records func(t *testing.T) int
}

func newOutboxBroker(t *testing.T, name string) *outboxBroker {
	t.Helper()
	switch name {
	case "nats":
		ns := natstest.Start(t)
		b := &outboxBroker{url: ns.URL, destination: "payments.charge.created",
			// JetStream redelivers a killed consumer's messages after 2s.
			consumerArgs: []string{"-nats-url", ns.URL, "-ack-wait", "2s"}}
		var mu sync.Mutex
		b.kill = func() { mu.Lock(); defer mu.Unlock(); ns.Kill() }
		b.restart = func() { mu.Lock(); defer mu.Unlock(); ns.Restart(t) }
		_, js := ns.Connect(t)
		b.records = func(t *testing.T) int {
			s, err := js.Stream(t.Context(), streamName(b.destination))
			if err != nil {
				t.Logf("stream: %v", err)
				return -1
			}
			info, err := s.Info(t.Context())
			if err != nil {
				t.Logf("stream info: %v", err)
				return -1
			}
			return int(info.State.Msgs)
		}
		return b
	case "rabbitmq":
		amqptest.Conn(t) // fails or skips the test if none answers
		queue := amqptest.Name("payments.charge.created")
		// The server's relay declares the queue; it is deleted at the end on
		// a connection of that moment (amqptest.Conn's, idle through the
		// test, was once found closed by then).
		t.Cleanup(func() {
			conn, err := amqp.Dial(amqptest.URL())
			if err == nil {
				var ch *amqp.Channel
				if ch, err = conn.Channel(); err == nil {
					_, err = ch.QueueDelete(queue, false, false, false)
				}
				conn.Close()
			}
			if err != nil {
				t.Errorf("delete test queue: %v", err)
			}
		})
		return &outboxBroker{url: amqptest.URL(), destination: queue,
			consumerArgs: []string{"-amqp-url", amqptest.URL(), "-queue", queue},
			records:      func(*testing.T) int { return -1 }}
	}
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, brokers, "payments.charge.created", kafkaPartitions, kafkatest.Retention(MaxStreamAge, kafkaSegment))
	adm := kadm.NewClient(kafkatest.Client(t, brokers))
	return &outboxBroker{url: "kafka://" + strings.Join(brokers, ","), destination: topic, spareConsumer: *outboxKills <= 1,
		consumerArgs: []string{"-kafka-brokers", strings.Join(brokers, ","), "-topic", topic, "-name", kafkatest.Name("receipts"),
			"-kafka-session-timeout", "3s", "-handler-timeout", "5s"},
		records: func(t *testing.T) int {
			ends, err := adm.ListEndOffsets(t.Context(), topic)
			if err != nil {
				t.Logf("end offsets: %v", err)
				return -1
			}
			n := 0
			ends.Each(func(o kadm.ListedOffset) { n += int(o.Offset) })
			return n
		}}
}

func testOutboxKilled(t *testing.T, name string) {
	began := time.Now()
	n := *outboxCharges
	b := newOutboxBroker(t, name)
	serverSchema, consumerSchema := pgtest.Schema(t), pgtest.Schema(t)
	serverDB, consumerDB := pgtest.Pool(t, serverSchema), pgtest.Pool(t, consumerSchema)
	_, processorURL := startProcessor(t, false)
	addr := freeAddr(t)
	serverBin := servertest.Build(t)
	serverArgs := []string{"-database-url", pgtest.SchemaURL(serverSchema), "-outbox", b.url, "-outbox-destination", b.destination,
		"-processor-url", processorURL}

	server := supervise(t, "server", "payment service listening", serverBin, append(serverArgs, "-addr", addr, "-fail-after-write", "3")...)
	relay := supervise(t, "relay", "relay running", serverBin, append(serverArgs, "-relay-only")...)
	cons := supervise(t, "consumer", "msg=consuming", consumerBinary(t), append(b.consumerArgs, "-receipts", "-database-url", pgtest.SchemaURL(consumerSchema))...)
	parts := []*supervised{server, relay, cons}

	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cl := charge{client: paymentsv1.NewPaymentServiceClient(conn), prefix: "key-" + serverSchema + "-"}
	done := make(chan struct{})
	ids := make([]string, n)
	go func() {
		defer close(done)
		cl.all(t, ids)
	}()

	// The chaos: at random times, one of the parts (and on NATS the
	// broker) is killed, and restarted a moment later. A part that exited
	// on its own (the consumer cannot start while NATS is down) is started
	// again.
	kills := map[string]int{}
	victims := []string{"server", "relay", "consumer"}
	if b.spareConsumer {
		victims = victims[:2]
	}
	if b.kill != nil {
		victims = append(victims, "broker")
	}
	// Until the client is done and each victim was killed -outbox-kills times.
	madeIn := time.Duration(0)
	for madeIn == 0 || slices.ContainsFunc(victims, func(v string) bool { return kills[v] < *outboxKills }) {
		select {
		case <-done:
			if madeIn == 0 {
				madeIn = time.Since(began)
			}
		default:
		}
		time.Sleep(time.Duration(200+rand.IntN(800)) * time.Millisecond)
		v := victims[rand.IntN(len(victims))]
		kills[v]++
		down := time.Duration(rand.IntN(500)) * time.Millisecond
		switch v {
		case "broker":
			b.kill()
			time.Sleep(down)
			b.restart()
		default:
			p := map[string]*supervised{"server": server, "relay": relay, "consumer": cons}[v]
			p.kill()
			time.Sleep(down)
		}
		for _, p := range parts {
			p.ensure(t)
		}
	}
	if t.Failed() {
		return
	}

	// Every charge is sent and has its receipt once the parts run on. Six
	// minutes: on kfake, a group whose members were killed in a burst was
	// seen to hold its partitions three minutes (a JoinGroup unanswered
	// until kgo's read timeout, then the rebalance timeout) before its last
	// member consumed.
	var last string
	waitFor(t, 6*time.Minute, "every charge's message is sent and has its receipt", func() bool {
		for _, p := range parts {
			p.ensure(t)
		}
		unsent := count(t, serverDB, `SELECT count(*) FROM idempotency_keys_outbox WHERE sent_at IS NULL`)
		rs := count(t, consumerDB, `SELECT count(*) FROM receipts`)
		if now := fmt.Sprintf("%d messages unsent, %d receipts of %d charges", unsent, rs, n); now != last {
			last = now
			t.Logf("%s: %s", time.Since(began).Round(time.Second), last) // what a timeout waited for
		}
		// And every part runs, started, so that the stops below stop
		// none while it starts.
		return unsent == 0 && rs >= n && !slices.ContainsFunc(parts, func(p *supervised) bool { return !p.ready() })
	})
	t.Logf("%s: %s", t.Name(), last)

	charges := strings1(t, serverDB, `SELECT id FROM charges`)
	receipts := strings1(t, consumerDB, `SELECT charge_id FROM receipts`)
	announced := announcedCharges(t, serverDB)
	if len(charges) != n {
		t.Errorf("%d charges for %d keys, want one a key", len(charges), n)
	}
	for i, id := range ids {
		if !charges[id] {
			t.Errorf("charge %d: the client got %q, which the ledger does not hold", i, id)
		}
	}
	if lost, extra := diff(charges, receipts); len(lost) > 0 || len(extra) > 0 {
		t.Errorf("%d charges without a receipt, %d receipts of no charge", len(lost), len(extra))
	}
	if lost, extra := diff(charges, announced); len(lost) > 0 || len(extra) > 0 {
		t.Errorf("%d charges without a message, %d messages of no charge (a rolled-back charge's)", len(lost), len(extra))
	}
	doubles := count(t, consumerDB, `SELECT count(*) FROM receipts WHERE duplicates > 0`)
	if doubles != 0 {
		t.Errorf("%d charges got a second receipt (caught by the receipts' unique constraint, not by idemkey)", doubles)
	}
	rolledBack := int(cl.rolledBack.Load())
	if rolledBack == 0 {
		t.Errorf("no call failed after its write (-fail-after-write): no charge was rolled back")
	}

	consumers := cons.all()
	dropped := countAll(consumers, "msg=message", "outcome=duplicate")
	// A copy the relay sent again reaches the consumer as a first delivery
	// (RabbitMQ's redelivered=false, JetStream's delivered=1, though
	// JetStream drops a resend within its duplicate window: its stream
	// holds one record a charge), a copy the broker delivered again (its
	// consumer died before the ack) as a redelivery; but a nats-server
	// killed may lose a consumer's delivery counts, and deliver again as
	// for the first time. Kafka tells neither: its resends are its records
	// beyond one a charge.
	resent := countLines(consumers, func(line string) bool {
		return containsAll(line, []string{"msg=message", "outcome=duplicate"}) &&
			(strings.Contains(line, "redelivered=false") || firstDelivery.MatchString(line))
	})
	claimedAgain := count(t, serverDB, `SELECT count(*) FROM idempotency_keys_outbox WHERE attempts > 1`)
	records := b.records(t)
	t.Logf("%s: %d charges (%d calls retried, %d rolled back after their write) in %s; kills %v (server and relay processes: %d and %d); "+
		"%d messages claimed more than once by a relay; the broker holds %d records (-1: not counted); "+
		"%d deliveries dropped by the consumer as duplicates (%d of them first deliveries: copies the relay sent again, or on NATS redeliveries whose count a kill of the broker lost); %d receipts, 0 twice; all settled in %s",
		t.Name(), len(charges), cl.retried.Load(), rolledBack, madeIn.Round(time.Millisecond), kills, len(server.all()), len(relay.all()),
		claimedAgain, records, dropped, resent, len(receipts), time.Since(began).Round(time.Millisecond))
	for _, p := range append(append(server.all(), relay.all()...), consumers...) {
		if p.count("DATA RACE") > 0 {
			t.Errorf("%s: the race detector found a data race", p.name)
		}
	}
	neverLogged(t, append(append(server.all(), relay.all()...), consumers...), cl.prefix)
	for _, p := range parts {
		p.stop(t)
	}
}

// charge is the test's client: it makes charge i under key prefix+i,
// retrying until it gets the charge.
type charge struct {
	client              paymentsv1.PaymentServiceClient
	prefix              string
	retried, rolledBack atomic.Int64
}

// chargeRate bounds how many charges a second the client starts.
const chargeRate = 20

// all makes len(ids) charges, 8 at a time, and keeps each one's id.
// They are started at most chargeRate a second, so that the kills fall
// among them: 200 take 10 s, 1000 take 50 s.
func (c *charge) all(t *testing.T, ids []string) {
	next := atomic.Int64{}
	tick := time.NewTicker(time.Second / chargeRate)
	defer tick.Stop()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(ids); i = int(next.Add(1)) - 1 {
				<-tick.C
				id, err := c.one(t.Context(), i)
				if err != nil {
					t.Errorf("charge %d: %v", i, err)
					return
				}
				ids[i] = id
			}
		})
	}
	wg.Wait()
}

func (c *charge) one(ctx context.Context, i int) (string, error) {
	tenant := []string{"sk_test_acme", "sk_test_globex"}[i%2]
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tenant, "idempotency-key", fmt.Sprint(c.prefix, i))
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_outbox", Amount: int64(100 + i), Currency: "EUR", Description: fmt.Sprint("charge ", i)}
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ch, err := c.client.CreateCharge(actx, req, grpc.WaitForReady(true))
		cancel()
		if err == nil {
			return ch.GetId(), nil
		}
		if strings.Contains(err.Error(), "-fail-after-write") {
			c.rolledBack.Add(1)
		}
		if attempt == 100 || ctx.Err() != nil {
			return "", fmt.Errorf("%d attempts, the last: %w", attempt, err)
		}
		c.retried.Add(1)
		time.Sleep(time.Duration(50+rand.IntN(200)) * time.Millisecond)
	}
}

// supervised is one part of the system, a command run again and again:
// killed by the test, or restarted when it exits on its own.
type supervised struct {
	name, bin string
	readyLine string // a line the process logs once it runs
	args      []string
	mu        sync.Mutex
	procs     []*proc // the last is the current one
}

func supervise(t *testing.T, name, readyLine, bin string, args ...string) *supervised {
	t.Helper()
	s := &supervised{name: name, readyLine: readyLine, bin: bin, args: args}
	s.ensure(t)
	return s
}

// ensure starts the command unless its current process runs.
func (s *supervised) ensure(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if k := len(s.procs); k > 0 {
		select {
		case <-s.procs[k-1].done:
		default:
			return // running
		}
	}
	p, err := launch(t, fmt.Sprintf("%s %d", s.name, len(s.procs)+1), s.bin, s.args...)
	if err != nil {
		t.Fatal(err)
	}
	s.procs = append(s.procs, p)
}

// ready reports whether the current process runs and has logged its
// ready line.
func (s *supervised) ready() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.procs) == 0 {
		return false
	}
	p := s.procs[len(s.procs)-1]
	select {
	case <-p.done:
		return false
	default:
		return p.count(s.readyLine) > 0
	}
}

// kill kills the current process with SIGKILL.
func (s *supervised) kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if k := len(s.procs); k > 0 {
		s.procs[k-1].kill()
	}
}

// stop stops the current process with SIGTERM.
func (s *supervised) stop(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if k := len(s.procs); k > 0 {
		s.procs[k-1].stop(t)
	}
}

func (s *supervised) all() []*proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*proc(nil), s.procs...)
}

// launch starts bin with args as a proc, without waiting for it to be
// ready; it is killed, if still running, when t ends, and its log shown if
// t failed; a data race it reports fails t.
func launch(t *testing.T, name, bin string, args ...string) (*proc, error) {
	cmd := exec.Command(bin, args...)
	// The process dies with the test, however the test ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		lines := bufio.NewScanner(stderr)
		lines.Buffer(nil, 1<<20)
		for lines.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, lines.Text())
			p.mu.Unlock()
		}
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		p.kill()
		if p.count("DATA RACE") > 0 {
			t.Errorf("%s: the race detector found a data race", p.name)
		}
		if t.Failed() {
			t.Logf("log of %s:\n%s", p.name, p.log())
		}
	})
	return p, nil
}

// freeAddr returns a loopback address with a free port, which the server
// listens on through its restarts.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// count runs a query of one count.
func count(t *testing.T, db *pgxpool.Pool, sql string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), sql).Scan(&n); err != nil {
		if strings.Contains(err.Error(), "42P01") { // not made yet
			return 0
		}
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// strings1 runs a query of one text column, and returns its values, each
// once, failing t if one comes twice.
func strings1(t *testing.T, db *pgxpool.Pool, sql string) map[string]bool {
	t.Helper()
	rows, _ := db.Query(t.Context(), sql)
	values, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	set := make(map[string]bool, len(values))
	for _, v := range values {
		if set[v] {
			t.Errorf("%s: %q twice", sql, v)
		}
		set[v] = true
	}
	return set
}

var (
	chargeID      = regexp.MustCompile(`"id":"(ch_[0-9a-f]+)"`)
	firstDelivery = regexp.MustCompile(` delivered=1( |$)`)
)

// countLines counts the lines of procs for which match holds.
func countLines(procs []*proc, match func(string) bool) int {
	n := 0
	for _, p := range procs {
		p.mu.Lock()
		for _, line := range p.lines {
			if match(line) {
				n++
			}
		}
		p.mu.Unlock()
	}
	return n
}

// announcedCharges returns the charges the outbox's messages announce, each
// once, failing t if one is announced twice or a message names none.
func announcedCharges(t *testing.T, db *pgxpool.Pool) map[string]bool {
	t.Helper()
	rows, _ := db.Query(t.Context(), `SELECT body FROM idempotency_keys_outbox`)
	bodies, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err != nil {
		t.Fatalf("read the outbox: %v", err)
	}
	set := make(map[string]bool, len(bodies))
	for _, body := range bodies {
		m := chargeID.FindSubmatch(body)
		if m == nil {
			t.Errorf("a message announces no charge")
			continue
		}
		if set[string(m[1])] {
			t.Errorf("charge %s announced twice", m[1])
		}
		set[string(m[1])] = true
	}
	return set
}

// diff returns what want holds and got does not (lost), and what got holds
// and want does not (extra).
func diff(want, got map[string]bool) (lost, extra []string) {
	for k := range want {
		if !got[k] {
			lost = append(lost, k)
		}
	}
	for k := range got {
		if !want[k] {
			extra = append(extra, k)
		}
	}
	return lost, extra
}
