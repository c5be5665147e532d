package main

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/tests/redistest"
)

// TestStoreOutage: a store that is down for longer than the broker delivers
// a message costs no message. The processed ids live in a Redis of the
// test's own, which is killed after a first message and restarted with its
// data (its append-only file) once every message sent meanwhile has had
// all its deliveries (-max-deliver 3, a backoff of at most 100ms): each of
// them waits on its last delivery, neither acknowledged unrun nor
// dead-lettered, and each is charged once when the store is back.
func TestStoreOutage(t *testing.T) {
	forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
		b := newBroker(t)
		redis := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
		schema := pgtest.Schema(t)
		db := pgtest.Pool(t, schema)
		args := append(b.args(""), "-redis-url", "redis://"+redis.Addr, "-database-url", pgtest.SchemaURL(schema),
			"-max-deliver", "3", "-backoff", "20ms", "-max-backoff", "100ms")
		p := start(t, "consumer", args...)
		send(t, b, "id-first-"+schema, "acme", body(0))
		waitFor(t, 30*time.Second, "the first charge", func() bool { return charges(t, db) == 1 })

		redis.Kill()
		const during = 4
		for i := 1; i <= during; i++ {
			send(t, b, fmt.Sprintf("id-%d-%s", i, schema), "acme", body(i))
		}
		// A message's last delivery finds the store down: it is held.
		waitFor(t, time.Minute, "a last delivery held", func() bool { return p.count("the delivery is held") > 0 })
		if n := p.count("msg=message", "action=ack"); n != 1 {
			t.Fatalf("%d messages acknowledged while the store was down, want only the first:\n%s", n, p.log())
		}
		if n := p.count("dead letter"); n != 0 {
			t.Fatalf("%d dead letters while the store was down, want none", n)
		}

		redis.Restart(t)
		waitFor(t, 2*time.Minute, "every message charged", func() bool { return charges(t, db) == 1+during })
		b.settled(t, p)
		if n := charges(t, db); n != 1+during {
			t.Fatalf("%d charges, want %d: each message once", n, 1+during)
		}
		if n := p.count("dead letter") + p.count("discarded"); n != 0 {
			t.Fatalf("%d messages dead-lettered or discarded, want none:\n%s", n, p.log())
		}
		if n := p.count("data lost"); n != 0 {
			t.Fatalf("the store restarted with its data, but %d lines say it lost some", n)
		}
	})
}

// TestStopDuringOutage: a consumer stopped while a last delivery waits for
// its store stops within its grace, and acknowledges nothing it did not run.
func TestStopDuringOutage(t *testing.T) {
	forEachBroker(t, func(t *testing.T, newBroker func(*testing.T) broker) {
		b := newBroker(t)
		redis := redistest.Start(t)
		args := append(b.args(""), "-redis-url", "redis://"+redis.Addr,
			"-max-deliver", "2", "-backoff", "20ms", "-max-backoff", "100ms")
		p := start(t, "consumer", args...)
		redis.Kill()
		schema := pgtest.Schema(t) // a unique id
		send(t, b, "id-held-"+schema, "acme", body(1))
		waitFor(t, time.Minute, "a last delivery held", func() bool { return p.count("the delivery is held") > 0 })
		p.stop(t) // within 30s: the grace is 10s
		if n := p.count("msg=message", "action=ack"); n != 0 {
			t.Fatalf("%d messages acknowledged, want none:\n%s", n, p.log())
		}
		if n := p.count("neither run nor dead-lettered"); n != 1 {
			t.Fatalf("the stop of the held delivery was logged %d times, want once:\n%s", n, p.log())
		}
	})
}

// TestHandlerTimeoutOutlastsLease: a handler timeout that the engine's
// longest lease (10 minutes) would cut short is refused at start, naming
// both settings, rather than let a redelivery run a handler beside itself.
// (consumer.New refuses it, once the broker's consumer is there.)
func TestHandlerTimeoutOutlastsLease(t *testing.T) {
	b := newNATS(t, false)
	out, err := exec.Command(consumerBinary(t), append(b.args(""), "-handler-timeout", "10m")...).CombinedOutput()
	if err == nil {
		t.Fatalf("the consumer started with a handler timeout of 10m:\n%s", out)
	}
	if !strings.Contains(string(out), "consumer.WithHandlerTimeout") || !strings.Contains(string(out), "engine.WithMaxLease") {
		t.Fatalf("the refusal does not name both settings:\n%s", out)
	}
}
