package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/hooklog"
	"github.com/idemkey/idemkey/internal/logtest"
)

const secret = "tenant-secret/msg-secret-id"

// TestHooks: each delivery runs one hook, before Process returns: one
// execution of a message however often it is redelivered, then a replay
// for each redelivery; a refusal for each message that cannot run.
func TestHooks(t *testing.T) {
	events := &hooklog.Log{Operation: "charges"}
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		h := &counter{}
		for i := range 3 {
			c.handle(t.Context(), delivery("msg-secret-id", i+1), h.handle)
		}
		events.Want(t,
			"execute executed ack "+secret+" 9",
			"replay replayed ack "+secret+" 9",
			"replay replayed ack "+secret+" 9")

		failing := &counter{err: errors.New("ledger unreachable")}
		c.handle(t.Context(), delivery("msg-secret-id-2", 1), failing.handle)
		failing.err = consumer.Final(errors.New("card declined"))
		c.handle(t.Context(), delivery("msg-secret-id-2", 2), failing.handle)
		c.handle(t.Context(), delivery("msg-secret-id-2", 3), failing.handle)
		events.Want(t,
			"execute executed nak "+secret+"-2 0",
			"execute executed ack "+secret+"-2 6",
			"replay replayed ack "+secret+"-2 6")

		reused := delivery("msg-secret-id", 4)
		reused.Body = []byte("another body")
		c.handle(t.Context(), reused, h.handle)
		c.handle(t.Context(), delivery("", 1), h.handle)
		c.Handle(t.Context(), msg{refused: errors.New("no tenant")})
		events.Want(t,
			"refuse reused reject "+secret+" 0",
			"refuse key_missing reject / 0",
			"refuse refused reject / 0")

		started, release := make(chan struct{}), make(chan struct{})
		first := make(chan consumer.Result, 1)
		go func() {
			first <- c.handle(t.Context(), delivery("msg-secret-id-3", 1), func(context.Context) error {
				close(started)
				<-release
				return nil
			})
		}()
		<-started
		c.handle(t.Context(), delivery("msg-secret-id-3", 2), h.handle)
		events.Want(t, "refuse in_progress nak "+secret+"-3 0")
		close(release)
		<-first
		events.Want(t, "execute executed ack "+secret+"-3 9")
	}, engine.WithHooks(events.Hooks()))
}

// TestHookPanics: a hook that panics changes neither the Result nor the
// record, and its panic is logged without the message's id or tenant
// (each checks the logs).
func TestHookPanics(t *testing.T) {
	events := &hooklog.Log{Operation: "charges"}
	events.Panics.Store(true)
	each(t, func(t *testing.T, c *testConsumer, logs *logtest.Buffer) {
		h := &counter{}
		for i, want := range []consumer.Outcome{consumer.Processed, consumer.Duplicate} {
			res := c.handle(t.Context(), delivery("msg-secret-id", i+1), h.handle)
			if res.Outcome != want || res.Action != consumer.Ack || res.Err != nil {
				t.Fatalf("delivery %d with a panicking hook: %+v, want %s and ack", i+1, res, want)
			}
		}
		if h.runs != 1 {
			t.Fatalf("handler ran %d times, want 1", h.runs)
		}
		events.Want(t, "execute executed ack "+secret+" 9", "replay replayed ack "+secret+" 9")
		if n := strings.Count(logs.String(), "hook panicked"); n != 2 {
			t.Errorf("%d hook panics logged, want 2:\n%s", n, logs)
		}
	}, engine.WithHooks(events.Hooks()))
}
