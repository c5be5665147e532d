// Package amqptest connects tests to a real RabbitMQ broker, on which each
// test declares queues of its own, with unique names, deleted when it ends.
//
// The broker is IDEMKEY_TEST_AMQP_URL, else DefaultURL. Where none answers,
// a test skips, except in CI (CI=true), where it fails: CI must never pass
// by skipping. A broker that answers with an error (a refused login, no such
// virtual host) fails the test everywhere.
package amqptest

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"os"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultURL is the broker tests use when IDEMKEY_TEST_AMQP_URL names none:
// a local rabbitmq-server with its default guest user.
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// URL returns the URL of the test broker.
func URL() string {
	if u := os.Getenv("IDEMKEY_TEST_AMQP_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Conn returns a connection to the test broker, closed when t ends.
func Conn(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.DialConfig(URL(), amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		unreachable(t, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Channel returns a channel on conn, closed when t ends (or before, by the
// test, to requeue what it has not acknowledged).
func Channel(t testing.TB, conn *amqp.Connection) *amqp.Channel {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open an AMQP channel: %v", err)
	}
	t.Cleanup(func() { ch.Close() })
	return ch
}

// Name returns a name no other test uses, for a queue or an exchange.
func Name(prefix string) string {
	var b [8]byte
	rand.Read(b[:])
	return "idemkey-test-" + prefix + "-" + hex.EncodeToString(b[:])
}

// Queue declares a durable queue with a unique name and args on conn,
// deleted with its messages when t ends, and returns its name.
func Queue(t testing.TB, conn *amqp.Connection, args amqp.Table) string {
	t.Helper()
	name := Name("queue")
	// A channel of its own: a channel error in the test (a refused
	// declaration, say) closes the test's channel, not this one.
	ch := Channel(t, conn)
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		t.Fatalf("declare queue: %v", err)
	}
	DeleteQueueAtEnd(t, conn, name)
	return name
}

// DeleteQueueAtEnd deletes queue when t ends, on a channel of its own: for a
// queue that Queue declared, or that the code under test did.
func DeleteQueueAtEnd(t testing.TB, conn *amqp.Connection, queue string) {
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("delete test queue: %v", err)
			return
		}
		defer ch.Close()
		if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
			t.Errorf("delete test queue: %v", err)
		}
	})
}

// Exchange declares a fanout exchange with a unique name, deleted when t
// ends, and returns its name: a dead-letter exchange, for one.
func Exchange(t testing.TB, conn *amqp.Connection) string {
	t.Helper()
	name := Name("exchange")
	ch := Channel(t, conn)
	if err := ch.ExchangeDeclare(name, amqp.ExchangeFanout, false, false, false, false, nil); err != nil {
		t.Fatalf("declare exchange: %v", err)
	}
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("delete test exchange: %v", err)
			return
		}
		defer ch.Close()
		if err := ch.ExchangeDelete(name, false, false); err != nil {
			t.Errorf("delete test exchange: %v", err)
		}
	})
	return name
}

// Empty fails t unless queue holds no message, ready or unacknowledged. Close
// the channels that consume it first: a closed channel's unacknowledged
// messages go back to the queue, so that they count as ready. Empty waits
// until the queue has no consumer left, which is when the broker has put
// them back.
func Empty(t testing.TB, conn *amqp.Connection, queue string) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("open an AMQP channel: %v", err)
	}
	defer ch.Close()
	var q amqp.Queue
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if q, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
			t.Fatalf("inspect queue: %v", err)
		}
		if q.Consumers == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the queue still has %d consumers: close their channels before Empty", q.Consumers)
		}
	}
	if q.Messages != 0 {
		t.Errorf("the queue holds %d messages, ready or unacknowledged; want none", q.Messages)
	}
}

// unreachable skips or fails a test that could not connect to the broker.
func unreachable(t testing.TB, err error) {
	t.Helper()
	where := redacted(URL())
	var amqpErr *amqp.Error
	switch {
	case errors.As(err, &amqpErr):
		t.Fatalf("RabbitMQ at %s refused the tests: %v", where, err)
	case os.Getenv("CI") == "true":
		t.Fatalf("no RabbitMQ broker at %s (%v). CI needs one: start it with rabbitmq-server -detached (Debian: apt-get install rabbitmq-server), or name one in IDEMKEY_TEST_AMQP_URL", where, err)
	default:
		t.Skipf("no RabbitMQ broker at %s (%v); start one with rabbitmq-server -detached", where, err)
	}
}

// redacted hides the password of an AMQP URL.
func redacted(u string) string {
	if p, err := url.Parse(u); err == nil {
		return p.Redacted()
	}
	return "IDEMKEY_TEST_AMQP_URL"
}
