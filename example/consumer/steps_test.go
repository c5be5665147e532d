package main

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/internal/pgtest"
)

// The tests of the processor's step (-processor-url) charge an
// example.Processor served by the test itself, so that its charges are
// counted across the consumer's kills. It does not honour keys: a step run
// twice is a second charge.

// startProcessor serves a processor that answers each charge at once or,
// with hang, charges and never answers; it stops when t ends.
func startProcessor(t *testing.T, hang bool) (*example.Processor, string) {
	t.Helper()
	p := example.NewProcessor(0, hang)
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close) // after the consumers' kills, which end a hung call
	return p, srv.URL
}

// forStepModes runs test on each broker (Kafka on kfake, unless
// IDEMKEY_TEST_KAFKA names one), in atomic and two-phase mode on
// PostgreSQL, in parallel; args are the consumer's flags for the mode, and
// id a message id of the test's own.
func forStepModes(t *testing.T, test func(t *testing.T, b broker, db *pgxpool.Pool, args []string, id string)) {
	for _, mode := range []string{"atomic", "two-phase"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
				b := newBroker(t)
				schema := pgtest.Schema(t)
				// JetStream redelivers a killed run's message 1s after.
				args := append(b.args("1s"), "-database-url", pgtest.SchemaURL(schema), "-atomic="+boolFlag(mode == "atomic"))
				test(t, b, pgtest.Pool(t, schema), args, "id-"+schema)
			})
		})
	}
}

func boolFlag(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// processorIDs returns the processor's ids kept with the charges.
func processorIDs(t *testing.T, db *pgxpool.Pool) []string {
	t.Helper()
	rows, _ := db.Query(t.Context(), `SELECT processor_charge_id FROM charges`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read the charges' processor ids: %v", err)
	}
	return ids
}

// wantOneCharge fails t unless the processor charged once and the ledger
// holds one charge, with a processor's id.
func wantOneCharge(t *testing.T, p *example.Processor, db *pgxpool.Pool) {
	t.Helper()
	if n := p.Count(); n != 1 {
		t.Errorf("the processor made %d charges, want 1", n)
	}
	if ids := processorIDs(t, db); len(ids) != 1 || !strings.HasPrefix(ids[0], "pch_") {
		t.Errorf("the charges hold the processor ids %q, want one charge with the processor's", ids)
	}
}

// A processor that charges and never answers, without reconcile: the first
// delivery's call times out (-processor-timeout 1s) and leaves the step
// started; each later delivery finds its outcome unknown and is held,
// never acknowledged unrun and never charged again, and the last
// (-max-deliver 3) is dead-lettered: logged as the example's dead letter
// and acknowledged. The ledger has no charge; the
// processor has one.
func TestStepOutcomeUnknownDeadLettered(t *testing.T) {
	forStepModes(t, func(t *testing.T, b broker, db *pgxpool.Pool, args []string, id string) {
		p, url := startProcessor(t, true)
		c := start(t, "consumer", append(args, "-processor-url", url, "-processor-timeout", "1s", "-reconcile=false",
			"-max-deliver", "3", "-backoff", "20ms", "-max-backoff", "100ms")...)
		send(t, b, id, "acme", body(1))
		const unknown = "a step's outcome is unknown"
		waitFor(t, 30*time.Second, "the last delivery is dead-lettered", func() bool {
			return c.count("dead letter", unknown) > 0
		})
		b.settled(t, c)
		// JetStream delivers a message 3 times; RabbitMQ 4, since its
		// x-delivery-limit counts the redeliveries. Kafka's attempts are
		// made in the consumer, which logs only the last.
		held := 1
		if _, kafka := b.(*kafkaBroker); !kafka {
			if n := c.count("msg=message", "action=nak", "code=Unavailable"); n != 1 {
				t.Errorf("%d deliveries failed for now as the processor did not answer, want the first only:\n%s", n, c.log())
			}
			if held = c.count("msg=message", "action=nak", unknown); held < 1 {
				t.Errorf("no delivery held as outcome unknown, want those between the first and the last:\n%s", c.log())
			}
		}
		if n := c.count("dead letter", unknown); n != 1 {
			t.Errorf("%d dead letters of an unknown outcome, want the last delivery's", n)
		}
		if n := c.count("idemkey: step: an earlier run started the step", "step=charge-card"); n != held+1 {
			t.Errorf("the engine logged the unknown outcome %d times, want once a delivery after the first, %d", n, held+1)
		}
		if n := c.count("outcome=processed") + c.count("outcome=duplicate"); n != 0 {
			t.Errorf("%d deliveries processed or dropped, want none", n)
		}
		if n := charges(t, db); n != 0 {
			t.Errorf("%d charges written, want none", n)
		}
		if n := p.Count(); n != 1 {
			t.Errorf("the processor made %d charges, want 1", n)
		}
		neverLogged(t, []*proc{c}, id)
	})
}

// The same processor with reconcile: the second delivery finds the step
// started, looks the charge up at the processor by the step's key, and
// writes it with the processor's id.
func TestStepOutcomeReconciled(t *testing.T) {
	forStepModes(t, func(t *testing.T, b broker, db *pgxpool.Pool, args []string, id string) {
		p, url := startProcessor(t, true)
		c := start(t, "consumer", append(args, "-processor-url", url, "-processor-timeout", "1s",
			"-max-deliver", "3", "-backoff", "20ms", "-max-backoff", "100ms")...)
		send(t, b, id, "acme", body(1))
		waitFor(t, 30*time.Second, "the message is processed", func() bool {
			return c.count("msg=message", "outcome=processed", "action=ack") == 1
		})
		b.settled(t, c)
		if _, kafka := b.(*kafkaBroker); !kafka { // Kafka's attempts are logged as one
			if n := c.count("msg=message", "action=nak", "code=Unavailable"); n != 1 {
				t.Errorf("%d deliveries failed for now as the processor did not answer, want the first only:\n%s", n, c.log())
			}
		}
		if n := c.count("idemkey: step:"); n != 0 {
			t.Errorf("the engine logged %d lines of the step, want none: reconcile found the charge:\n%s", n, c.log())
		}
		if n := c.count("dead letter"); n != 0 {
			t.Errorf("%d dead letters, want none", n)
		}
		wantOneCharge(t, p, db)
		neverLogged(t, []*proc{c}, id)
	})
}

// A consumer killed with SIGKILL after the processor's charge and before
// the charge's write (-handler-delay holds it there) has recorded the
// step's result: the redelivery, on a restarted consumer, gets the
// processor's id and writes the charge, and the processor has charged
// once. In two-phase mode the redelivery waits out the killed run's lease
// (-handler-timeout 2s, and 5s).
func TestStepKilledBeforeWrite(t *testing.T) {
	forStepModes(t, func(t *testing.T, b broker, db *pgxpool.Pool, args []string, id string) {
		p, url := startProcessor(t, false)
		args = append(args, "-processor-url", url, "-handler-timeout", "2s")
		first := start(t, "first run", append(args, "-handler-delay", "1h")...)
		send(t, b, id, "acme", body(1))
		waitFor(t, 30*time.Second, "the processor has charged", func() bool { return p.Count() == 1 })
		first.kill()
		if n := charges(t, db); n != 0 {
			t.Fatalf("%d charges written before the kill, want none: it fell after the write", n)
		}

		second := start(t, "second run", args...)
		waitFor(t, time.Minute, "the redelivery is processed", func() bool {
			return second.count("msg=message", "outcome=processed", "action=ack") == 1
		})
		b.settled(t, second)
		wantOneCharge(t, p, db)
		neverLogged(t, []*proc{first, second}, id)
	})
}
