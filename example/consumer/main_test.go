package main

// These tests run the consumer command as processes of its own, on the real
// brokers (tests/natstest, tests/amqptest) and PostgreSQL
// (internal/pgtest, a schema per test for the charges and idemkey's tables),
// kill them with SIGKILL where a crash would hurt, and count the charges
// with SQL. They read the processes' log lines to wait on their states.

import (
	"flag"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
)

var (
	messages = flag.Int("consumer-messages", 2000, "messages TestKilledMidStream publishes")
	modes    = flag.String("consumer-modes", "atomic,atomic-batch", "comma-separated modes TestKilledMidStream runs: atomic, atomic-batch (batches of 32), two-phase, two-phase-batch")
)

func TestMain(m *testing.M) {
	leakcheck.Main(m, func() {
		removeBinary()
		servertest.Cleanup() // TestOutboxKilled's server
	})
}

// A consumer killed after a message's charge committed, before it
// acknowledged the message, leaves it to be redelivered: the next run drops
// it as a duplicate and acknowledges it, and the charge is made once.
func TestKilledBeforeAck(t *testing.T) {
	forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
		b := newBroker(t)
		schema := pgtest.Schema(t)
		db := pgtest.Pool(t, schema)
		args := append(b.args("1s"), "-database-url", pgtest.SchemaURL(schema))

		first := start(t, "first run", append(args, "-ack-delay", "3s")...)
		id := "id-" + schema
		send(t, b, id, "acme", body(1))
		waitFor(t, 20*time.Second, "the charge is made", func() bool { return charges(t, db) == 1 })
		first.kill()
		if n := first.count("msg=message"); n != 0 {
			t.Fatalf("the first run settled %d messages before it was killed; want it killed before it acknowledged", n)
		}

		second := start(t, "second run", args...)
		waitFor(t, 30*time.Second, "the second run drops the redelivery", func() bool {
			return second.count("msg=message", "outcome=duplicate", "action=ack") == 1
		})
		b.settled(t, second)
		if n := second.count("outcome=processed"); n != 0 {
			t.Errorf("the second run processed %d messages; want none", n)
		}
		if n := charges(t, db); n != 1 {
			t.Errorf("%d charges, want 1", n)
		}
		neverLogged(t, []*proc{first, second}, id)
	})
}

// A consumer killed while a batch's handlers run, holding the keys of all
// its messages in one transaction, commits nothing of it: no charge, no
// record. Its messages are redelivered, and the next run charges each once.
func TestKilledMidBatch(t *testing.T) {
	forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
		const n = 10
		b := newBroker(t)
		schema := pgtest.Schema(t)
		db := pgtest.Pool(t, schema)
		app := "idemkey_test_" + schema // names the consumer's sessions
		args := append(b.args("3s"), "-database-url", pgtest.SchemaURL(schema, "application_name="+app), "-workers", "1")

		// One batch of all n: it waits long for them, and each charge takes
		// long before the batch commits.
		first := start(t, "first run", append(args, "-batch", fmt.Sprint(n), "-batch-wait", "30s", "-handler-delay", "5s")...)
		prefix := "id-" + schema + "-"
		for i := range n {
			send(t, b, prefix+fmt.Sprint(i), "acme", body(i))
		}
		waitFor(t, 20*time.Second, "the batch holds every message's key", func() bool { return advisoryLocks(t, db, app) == n })
		first.kill()
		if got := charges(t, db); got != 0 {
			t.Fatalf("%d charges committed by the killed batch, want none", got)
		}
		if got := processedRecords(t, db); got != 0 {
			t.Fatalf("%d records committed by the killed batch, want none", got)
		}
		if got := first.count("msg=message"); got != 0 {
			t.Fatalf("the killed run settled %d messages, want none", got)
		}

		second := start(t, "second run", append(args, "-batch", fmt.Sprint(n))...)
		waitFor(t, 30*time.Second, "every message is charged", func() bool { return processedRecords(t, db) == n })
		b.settled(t, second)
		if got, distinct := charges(t, db), distinctCharges(t, db); got != n || distinct != n {
			t.Errorf("%d charges of %d messages, want one per message, %d", got, distinct, n)
		}
		if got := second.count("msg=message", "outcome=processed", "action=ack"); got != n {
			t.Errorf("the second run processed %d messages, want %d", got, n)
		}
		neverLogged(t, []*proc{first, second}, prefix)
	})
}

// advisoryLocks counts the advisory locks that the sessions named app hold:
// those of a running atomic call, or batch, one per key.
func advisoryLocks(t *testing.T, db *pgxpool.Pool, app string) int {
	t.Helper()
	var n int
	err := db.QueryRow(t.Context(), `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = $1`, app).Scan(&n)
	if err != nil {
		t.Fatalf("count advisory locks: %v", err)
	}
	return n
}

// Two consumers share a durable consumer or queue, and a message's
// redelivery (JetStream: its ack wait passed; RabbitMQ: it was published
// twice) reaches one while the first run is still in its handler: it is
// delayed as busy, then dropped, and the charge is made once. Not on Kafka,
// which delivers a partition's records in order to one member: a duplicate
// meets a run in progress only from another partition (tests/idemkafka's
// TestRevokedPartitionNotCommitted has a member's records taken over).
func TestDuplicateMeetsRunInProgress(t *testing.T) {
	forBrokers(t, []string{"nats", "rabbitmq"}, func(t *testing.T, newBroker func(*testing.T) broker) {
		b := newBroker(t)
		schema := pgtest.Schema(t)
		db := pgtest.Pool(t, schema)
		// The handler timeout bounds the lease, and so how long the
		// duplicate is delayed: until the first run's lease ends.
		args := append(b.args("1s"), "-database-url", pgtest.SchemaURL(schema), "-handler-delay", "3s", "-handler-timeout", "4s")
		procs := []*proc{start(t, "consumer A", args...), start(t, "consumer B", args...)}
		_, rabbit := b.(*rabbitBroker)

		id := "id-" + schema
		send(t, b, id, "acme", body(1))
		if rabbit {
			// RabbitMQ redelivers only what a consumer gave up: publish the
			// duplicate once the first is taken, and in its handler delay.
			waitFor(t, 10*time.Second, "the message is taken", func() bool { return b.ready(t) == 0 })
			send(t, b, id, "acme", body(1))
		}
		waitFor(t, 20*time.Second, "a duplicate finds the message in progress", func() bool {
			return countAll(procs, "msg=message", "outcome=busy", "action=nak") > 0
		})
		// JetStream's redelivery is settled by the first run's ack while it
		// waits out its delay; RabbitMQ's published copy comes back as a
		// duplicate once the lease has ended.
		waitFor(t, 30*time.Second, "the first run acknowledges and a duplicate is dropped", func() bool {
			return countAll(procs, "msg=message", "outcome=processed", "action=ack") == 1 &&
				(!rabbit || countAll(procs, "msg=message", "outcome=duplicate", "action=ack") > 0)
		})
		b.settled(t, procs...)
		if n := countAll(procs, "outcome=processed"); n != 1 {
			t.Errorf("the message was processed %d times; want once", n)
		}
		if n := charges(t, db); n != 1 {
			t.Errorf("%d charges, want 1", n)
		}
		neverLogged(t, procs, id)
	})
}

// A message without an id, or with a tenant the command does not serve, is
// refused: terminated (JetStream) or rejected (RabbitMQ), without a charge.
func TestRefused(t *testing.T) {
	forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
		b := newBroker(t)
		schema := pgtest.Schema(t)
		db := pgtest.Pool(t, schema)
		p := start(t, "consumer", append(b.args(""), "-database-url", pgtest.SchemaURL(schema))...)

		id, tenant := "id-"+schema, "initech-"+schema
		send(t, b, "", "acme", body(1))
		send(t, b, id, tenant, body(2))
		waitFor(t, 20*time.Second, "both messages are refused", func() bool {
			return p.count("msg=message", "outcome=rejected", "action=reject") == 2
		})
		if n := p.count("outcome=rejected", "reason=", "no id"); n != 1 {
			t.Errorf("%d refusals say the message has no id; want 1", n)
		}
		if n := p.count("outcome=rejected", "reason=", "tenant"); n != 1 {
			t.Errorf("%d refusals name the tenant header; want 1", n)
		}
		b.settled(t, p)
		if n := charges(t, db); n != 0 {
			t.Errorf("%d charges, want none", n)
		}
		neverLogged(t, []*proc{p}, id, tenant)
	})
}

// A message first published longer ago than the retention, whose id has no
// record, is refused without a charge, and the consumer's log says why in
// words an operator reads: ErrExpired, the message's age and the retention,
// never its id or tenant. RabbitMQ carries the publisher's timestamp
// (JetStream stamps its own, so no message there can be that old).
func TestStaleMessageRefused(t *testing.T) {
	b := newRabbitMQ(t)
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t, schema)
	p := start(t, "consumer", append(b.args(""), "-database-url", pgtest.SchemaURL(schema))...)

	id, tenant := "id-"+schema, "acme"
	msg := amqp.Publishing{MessageId: id, Body: body(1), DeliveryMode: amqp.Persistent, ContentType: "application/json",
		Headers: amqp.Table{"tenant": tenant}, Timestamp: time.Now().Add(-8 * 24 * time.Hour)}
	c, err := b.ch.PublishWithDeferredConfirmWithContext(t.Context(), "", b.queue, true, false, msg)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := c.WaitContext(t.Context()); err != nil || !ok {
		t.Fatalf("RabbitMQ did not confirm the message: %v", err)
	}
	waitFor(t, 20*time.Second, "the stale message is refused", func() bool {
		return p.count("outcome=rejected") == 1
	})
	if n := p.count("sent longer ago than its id's record is kept", "age=192h", "retention=168h"); n != 1 {
		t.Errorf("%d log lines say the message was refused as expired, with its age and the retention; want 1:\n%s", n, p.log())
	}
	b.settled(t, p)
	if n := charges(t, db); n != 0 {
		t.Errorf("%d charges, want none", n)
	}
	neverLogged(t, []*proc{p}, id)
}

// The acceptance test: -consumer-messages (2,000) messages with
// unique ids, about a tenth of them published a second time, while the
// consumer is killed and restarted three times mid-stream, leave one charge
// per message and nothing pending. On Kafka, a second consumer joins the
// group after the first two restarts, and leaves it once it is assigned
// partitions: two rebalances more, each moving partitions, with records in
// hand where any are left in them. In two-phase mode (make consumer-soak) a
// kill between a charge and its record may charge a message twice: those
// are counted and logged, not failed.
func TestKilledMidStream(t *testing.T) {
	for _, mode := range strings.Split(*modes, ",") {
		if mode != "atomic" && mode != "atomic-batch" && mode != "two-phase" && mode != "two-phase-batch" {
			t.Fatalf("-consumer-modes: %q is none of atomic, atomic-batch, two-phase and two-phase-batch", mode)
		}
		atomic, batch := !strings.HasPrefix(mode, "two-phase"), 1
		if strings.HasSuffix(mode, "-batch") {
			batch = 32
		}
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			t.Run("kafka", func(t *testing.T) {
				t.Parallel()
				testKilledMidStream(t, newKafka(t), atomic, batch)
			})
			t.Run("nats", func(t *testing.T) {
				t.Parallel()
				testKilledMidStream(t, newNATS(t, true), atomic, batch)
			})
			t.Run("rabbitmq", func(t *testing.T) {
				t.Parallel()
				testKilledMidStream(t, newRabbitMQ(t), atomic, batch)
			})
		})
	}
}

func testKilledMidStream(t *testing.T, b broker, atomic bool, batch int) {
	began := time.Now()
	n := *messages
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t, schema)
	// JetStream redelivers what a killed run had in hand (up to the 500
	// messages its Consume fetches ahead) once the ack wait passes: 5s, not
	// the 30s default, keeps the test short.
	args := append(b.args("5s"), "-database-url", pgtest.SchemaURL(schema), fmt.Sprint("-atomic=", atomic), fmt.Sprint("-batch=", batch))
	cur := start(t, "run 1", args...)
	procs := []*proc{cur}

	// The messages are published while the consumer runs, and is killed:
	// every one once, then every tenth again, once JetStream's duplicate
	// window (100ms on this stream) has passed for it, which the consumer
	// must drop.
	prefix := "id-" + schema + "-"
	dups := (n + 9) / 10
	published := make(chan error, 1)
	go func() {
		published <- func() error {
			for i := range n + dups {
				m := i
				if i >= n {
					m = (i - n) * 10
				}
				if err := b.publish(t.Context(), prefix+fmt.Sprint(m), "acme", body(m)); err != nil {
					return err
				}
			}
			return b.flush(t.Context())
		}()
	}()
	var publishedIn time.Duration
	checkPublished := func() bool {
		if publishedIn > 0 {
			return true
		}
		select {
		case err := <-published:
			if err != nil {
				t.Fatal(err)
			}
			publishedIn = time.Since(began)
			return true
		default:
			return false
		}
	}

	var killedAt []int
	rebalances := 0
	for k := 1; k <= 3; k++ {
		want := k * n / 4
		waitFor(t, 2*time.Minute, fmt.Sprintf("%d messages are charged", want), func() bool {
			checkPublished()
			return distinctCharges(t, db) >= want
		})
		cur.kill()
		killedAt = append(killedAt, distinctCharges(t, db))
		cur = start(t, fmt.Sprintf("run %d", k+1), args...)
		procs = append(procs, cur)
		if _, kafka := b.(*kafkaBroker); kafka && k < 3 {
			// At debug level it logs kgo's group lines: it has partitions
			// once its first session begins, whether or not records are
			// left in them.
			joiner := start(t, fmt.Sprintf("joiner %d", k), append(args, "-log-level", "debug")...)
			waitFor(t, 2*time.Minute, joiner.name+" is assigned partitions", func() bool {
				checkPublished()
				return joiner.count("kafka: new group session begun", `added="payments-`) > 0
			})
			joiner.stop(t) // it leaves the group: its partitions move back
			rebalances++
			procs = append(procs, joiner)
		}
	}
	// Every message is recorded as processed: in two-phase mode, a message
	// whose run was killed stays in progress until its lease ends (a
	// minute), and its redeliveries meanwhile are busy.
	waitFor(t, 3*time.Minute, "every message is published and recorded as processed", func() bool {
		return checkPublished() && processedRecords(t, db) == n
	})
	rb, ok := b.(*rabbitBroker)
	if !ok {
		b.settled(t, cur)
	}
	for round := 1; ok; round++ {
		// RabbitMQ counts only the messages ready, not those in hand. A
		// duplicate in hand when the last run stops, held as busy for its
		// delay, is requeued by the stop: a run without kills takes it.
		waitFor(t, time.Minute, "no message is ready", func() bool { return rb.ready(t) == 0 })
		cur.stop(t)
		left := rb.left(t)
		if left == 0 {
			break
		}
		if round == 3 {
			t.Fatalf("%d messages left in the queue after %d runs without kills", left, round)
		}
		t.Logf("%d messages requeued as the last run stopped; another run takes them", left)
		cur = start(t, fmt.Sprintf("drain %d", round), args...)
		procs = append(procs, cur)
	}

	total := charges(t, db)
	twice := doubleCharges(t, db)
	duplicates := countAll(procs, "msg=message", "outcome=duplicate", "action=ack")
	t.Logf("%s: %d messages (%d published again), 3 kills (at %v messages charged), %d consumers joined and left, %d charges, %d messages charged more than once, %d duplicates dropped; published in %s, all settled in %s",
		t.Name(), n, dups, killedAt, rebalances, total, len(twice), duplicates, publishedIn.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	if len(twice) > 0 {
		t.Logf("%s: messages charged more than once: %s", t.Name(), strings.Join(twice, ", "))
	}
	switch {
	case atomic && (total != n || len(twice) != 0):
		t.Errorf("%d charges, %d messages charged more than once; want %d charges, one per message", total, len(twice), n)
	case total < n:
		t.Errorf("%d charges; want at least %d, one per message", total, n)
	}
	if duplicates == 0 {
		t.Errorf("no message was dropped as a duplicate; %d were published again", dups)
	}
	if n := countAll(procs, "outcome=rejected"); n != 0 {
		t.Errorf("%d messages refused; want none", n)
	}
	neverLogged(t, procs, prefix)
}

// distinctCharges counts the messages charged, once however many times.
func distinctCharges(t *testing.T, db *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), `SELECT count(DISTINCT description) FROM charges`).Scan(&n); err != nil {
		t.Fatalf("count charges: %v", err)
	}
	return n
}

// processedRecords counts the message ids recorded as processed, in
// idemkey's table.
func processedRecords(t *testing.T, db *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := db.QueryRow(t.Context(), `SELECT count(*) FROM idempotency_keys WHERE state = 'completed'`).Scan(&n); err != nil {
		t.Fatalf("count records: %v", err)
	}
	return n
}

// doubleCharges returns the descriptions of the messages charged more than
// once, with how many times.
func doubleCharges(t *testing.T, db *pgxpool.Pool) []string {
	t.Helper()
	rows, _ := db.Query(t.Context(), `SELECT description || ' ×' || count(*) FROM charges GROUP BY description HAVING count(*) > 1 ORDER BY min(create_time)`)
	twice, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("count charges per message: %v", err)
	}
	return twice
}

// TestConnectionLost: RabbitMQ closes the consumer's connection while it
// charges (as a broker restart or a network partition would); the consumer
// connects again and every message is charged once.
func TestConnectionLost(t *testing.T) {
	rabbitmqctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		rabbitmqctl = "/usr/sbin/rabbitmqctl"
	}
	b := newRabbitMQ(t)
	schema := pgtest.Schema(t)
	db := pgtest.Pool(t, schema)
	p := start(t, "consumer", append(b.args(""), "-database-url", pgtest.SchemaURL(schema), "-handler-delay", "15ms", "-workers", "1")...)
	const n = 400
	for i := range n {
		send(t, b, fmt.Sprintf("id-%d-%s", i, schema), "acme", body(i))
	}
	waitFor(t, 20*time.Second, "a tenth of the charges", func() bool { return charges(t, db) >= n/10 })
	// Close the consumer's connection from the broker's side.
	out, err := exec.Command(rabbitmqctl, "list_connections", "-q", "--no-table-headers", "pid", "client_properties").Output()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v", err)
	}
	closed := 0
	for line := range strings.Lines(string(out)) {
		pid, props, ok := strings.Cut(strings.TrimSpace(line), "\t")
		if ok && strings.Contains(props, "of "+b.queue+`"`) { // the consumer's connection_name
			if out, err := exec.Command(rabbitmqctl, "close_connection", pid, "closed by a test").CombinedOutput(); err != nil {
				t.Fatalf("rabbitmqctl close_connection: %v: %s", err, out)
			}
			closed++
		}
	}
	if closed != 1 || charges(t, db) == n {
		t.Fatalf("closed %d connections of the consumer (%d charges made), want 1 while it charges:\n%s", closed, charges(t, db), out)
	}
	waitFor(t, 30*time.Second, "every charge", func() bool { return charges(t, db) >= n })
	b.settled(t, p)
	if got := charges(t, db); got != n {
		t.Fatalf("%d charges, want %d", got, n)
	}
	if p.count("connection lost; connecting again") != 1 || p.count("msg=consuming") != 2 {
		t.Fatalf("the consumer did not connect again:\n%s", p.log())
	}
}
