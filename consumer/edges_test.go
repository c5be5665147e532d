package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
)

// TestLastDeliveryStoreDown: a store that fails is no reason to spend a
// message's last delivery. The delivery is held, neither acknowledged nor
// dead-lettered, while the store fails, and the message runs once when it
// answers again: here its table is locked by an operator's transaction,
// which each try outwaits for 100ms.
func TestLastDeliveryStoreDown(t *testing.T) {
	st, pool := pgStoreAndPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["lock_timeout"] = "100ms"
	})
	for _, atomic := range []bool{false, true} {
		opts := []consumer.Option{consumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond)}
		if atomic {
			opts = append(opts, consumer.WithAtomic())
		}
		logger, logs := logtest.New()
		c := newConsumer(t, st, []engine.Option{engine.WithLogger(logger)}, opts...)
		lock, err := pool.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := lock.Exec(t.Context(), `LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		d := delivery(fmt.Sprintf("msg-secret-id-%v", atomic), 5)
		d.Last = true
		h := &counter{}
		done := make(chan consumer.Result, 1)
		go func() { done <- c.handle(context.WithoutCancel(t.Context()), d, h.handle) }()
		// Three failed tries of the store's, at least: the delivery was
		// tried again after the first.
		for deadline := time.Now().Add(time.Minute); strings.Count(logs.String(), "level=ERROR") < 3; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("atomic %v: the store did not fail three times within a minute:\n%s", atomic, logs)
			}
		}
		select {
		case res := <-done:
			t.Fatalf("atomic %v: the last delivery returned while the store failed: %+v", atomic, res)
		default:
		}
		if err := lock.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
		res := <-done
		if res.Outcome != consumer.Processed || res.Action != consumer.Ack || res.DeadLetter || h.runs != 1 {
			t.Fatalf("atomic %v: %+v after %d runs, want it processed once when the store answered", atomic, res, h.runs)
		}
		if !strings.Contains(logs.String(), "the delivery is held") {
			t.Fatalf("atomic %v: the hold was not logged:\n%s", atomic, logs)
		}
	}
}

// TestLastDeliveryStoreDownStops: a consumer that stops while a last
// delivery waits for its store negative-acknowledges it: never acknowledged
// unrun, never dead-lettered for the store's failure.
func TestLastDeliveryStoreDownStops(t *testing.T) {
	st, pool := pgStoreAndPool(t)
	logger, logs := logtest.New()
	c := newConsumer(t, st, []engine.Option{engine.WithLogger(logger)}, consumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond))
	pool.Close() // the store is down for good
	ctx, cancel := context.WithCancel(t.Context())
	d := delivery("msg-secret-id", 5)
	d.Last = true
	done := make(chan consumer.Result, 1)
	h := &counter{}
	go func() { done <- c.handle(ctx, d, h.handle) }()
	for deadline := time.Now().Add(time.Minute); !strings.Contains(logs.String(), "the delivery is held"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the hold was not logged within a minute:\n%s", logs)
		}
	}
	cancel()
	res := <-done
	if res.Outcome != consumer.StoreFailed || res.Action != consumer.Nak || res.DeadLetter || h.runs != 0 {
		t.Fatalf("%+v after %d runs, want a nak, not dead-lettered, the handler not run", res, h.runs)
	}
	if !strings.Contains(logs.String(), "neither run nor dead-lettered") {
		t.Fatalf("the stop was not logged:\n%s", logs)
	}
}

// TestDiscardDeadLetters: with no hook (WithDiscardDeadLetters), a message
// to dead-letter is logged as discarded, never as dead-lettered, and its
// action stands; a hook that fails has the message delivered again.
func TestDiscardDeadLetters(t *testing.T) {
	logger, logs := logtest.New()
	c := newConsumer(t, memory.New(), []engine.Option{engine.WithLogger(logger)})
	res := c.handle(t.Context(), delivery("msg-secret-id", 1), func(context.Context) error {
		return consumer.Final(errors.New("declined body-secret"))
	})
	if res.Outcome != consumer.Failed || res.Action != consumer.Ack {
		t.Fatalf("%+v, want failed and acknowledged", res)
	}
	if !strings.Contains(logs.String(), "failed for good is discarded") || strings.Contains(logs.String(), "dead-lettered") ||
		!strings.Contains(logs.String(), "a final error (consumer.Final) of type *errors.errorString") {
		t.Fatalf("the discard was not logged as one, with the final error's type:\n%s", logs)
	}
	failing := consumer.WithDeadLetter(func(context.Context, msg, error) error { return errors.New("the dead-letter subject is down") })
	c = newConsumer(t, memory.New(), []engine.Option{engine.WithLogger(logger)}, failing)
	res = c.handle(t.Context(), delivery("msg-secret-id", 1), func(context.Context) error {
		return consumer.Final(errors.New("declined body-secret"))
	})
	if res.Outcome != consumer.Failed || res.Action != consumer.Nak || !res.DeadLetter {
		t.Fatalf("a dead letter whose hook failed: %+v, want failed and delivered again", res)
	}
	if !strings.Contains(logs.String(), "the dead-letter hook failed") {
		t.Fatalf("the hook's failure was not logged:\n%s", logs)
	}
}

// TestHandlerTimeoutOutlastsLease: a handler timeout whose lease (the
// timeout and five seconds) the engine's longest lease would cut short is
// refused, naming both settings: the lease would end while the handler
// runs, and a redelivery would run it again beside itself.
func TestHandlerTimeoutOutlastsLease(t *testing.T) {
	for _, tc := range []struct {
		maxLease, timeout time.Duration
		ok                bool
	}{
		{2 * time.Second, 10 * time.Second, false},
		{2 * time.Second, time.Second, false}, // the lease would be 2s, not 6s
		{15 * time.Second, 10 * time.Second, true},
		{engine.DefaultMaxLease, 9*time.Minute + 55*time.Second, true},
		{engine.DefaultMaxLease, 9*time.Minute + 56*time.Second, false},
	} {
		eng, err := engine.New(memory.New(), engine.WithMaxLease(tc.maxLease), engine.WithLogger(nil))
		if err != nil {
			t.Fatal(err)
		}
		_, err = consumer.New(eng, "charges", testBroker{}, run, consumer.WithDiscardDeadLetters(), consumer.WithHandlerTimeout(tc.timeout))
		if tc.ok != (err == nil) {
			t.Errorf("max lease %v, timeout %v: %v, want ok %v", tc.maxLease, tc.timeout, err, tc.ok)
		}
		if err != nil && (!strings.Contains(err.Error(), "consumer.WithHandlerTimeout") || !strings.Contains(err.Error(), "engine.WithMaxLease")) {
			t.Errorf("max lease %v, timeout %v: %v, want both settings named", tc.maxLease, tc.timeout, err)
		}
	}
}

// TestOneClassification: a consumer classifies a handler's error as the
// gRPC interceptor does: InvalidArgument releases (the message is
// redelivered), a recorded code is final, and Final makes any error final.
func TestOneClassification(t *testing.T) {
	for _, tc := range []struct {
		err   error
		final bool
	}{
		{status.Error(codes.InvalidArgument, "bad"), false},
		{status.Error(codes.Unavailable, "down"), false},
		{errors.New("down"), false},
		{status.Error(codes.FailedPrecondition, "declined"), true},
		{status.Error(codes.Unknown, "unknown"), true},
		{consumer.Final(status.Error(codes.InvalidArgument, "bad")), true},
	} {
		if got := consumer.IsFinal(tc.err); got != tc.final {
			t.Errorf("IsFinal(%v) = %v, want %v", tc.err, got, tc.final)
		}
	}
}

// TestLastDeliveryDeadLetterHeld: a dead-letter hook that fails on a
// message's last delivery is tried again until it takes the message, since
// the broker would not deliver it again; a consumer that stops meanwhile
// negative-acknowledges it and says so at Error level.
func TestLastDeliveryDeadLetterHeld(t *testing.T) {
	logger, logs := logtest.New()
	fails := 2
	var calls int
	hook := consumer.WithDeadLetter(func(context.Context, msg, error) error {
		calls++
		if calls <= fails {
			return errors.New("the dead-letter subject is down")
		}
		return nil
	})
	c := newConsumer(t, memory.New(), []engine.Option{engine.WithLogger(logger)}, hook, consumer.WithBackoff(time.Millisecond, 5*time.Millisecond))
	last := delivery("msg-secret-id", 3)
	last.Last = true
	declined := func(context.Context) error { return consumer.Final(errors.New("declined body-secret")) }
	res := c.handle(t.Context(), last, declined)
	if res.Outcome != consumer.Failed || res.Action != consumer.Ack || !res.DeadLetter || calls != 3 {
		t.Fatalf("%+v after %d calls of the hook, want failed and acknowledged once the third call took it", res, calls)
	}
	if n := strings.Count(logs.String(), "tried again until it takes the message"); n != 2 {
		t.Fatalf("%d failures of the hook logged, want 2:\n%s", n, logs)
	}

	fails, calls = 1<<30, 0
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan consumer.Result, 1)
	last.ID = "msg-secret-id-2"
	go func() { done <- c.handle(ctx, last, declined) }()
	for deadline := time.Now().Add(time.Minute); strings.Count(logs.String(), "tried again until it takes the message") < 4; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the hook was not tried again within a minute:\n%s", logs)
		}
	}
	cancel()
	if res := <-done; res.Action != consumer.Nak {
		t.Fatalf("%+v, want a nak once the consumer stopped", res)
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "before the consumer stopped") {
		t.Fatalf("the stop was not logged at Error level:\n%s", logs)
	}
	if strings.Contains(logs.String(), "secret") {
		t.Fatalf("the logs hold a raw id or body:\n%s", logs)
	}
}

// TestRetention: a consumer's own retention (WithRetention) is what New
// checks against the broker's horizon, and what decides that a message sent
// long ago is expired, whatever its engine's.
func TestRetention(t *testing.T) {
	eng, err := engine.New(memory.New(), engine.WithRetention(time.Hour), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	b := testBroker{system: "test", horizons: []consumer.Horizon{{Bound: 72 * time.Hour, Source: "stream S: max age"}}}
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters()); err == nil {
		t.Fatal("New on the engine's hour, with a horizon of three days: accepted")
	}
	c, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), consumer.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		t.Fatalf("New with a week's retention: %v", err)
	}
	h := &counter{}
	d := delivery("msg-secret-id", 1)
	d.Sent = time.Now().Add(-48 * time.Hour)
	if res := c.Handle(t.Context(), msg{d: d, h: h.handle}); res.Outcome != consumer.Processed || h.runs != 1 {
		t.Fatalf("a message sent two days ago, ids kept a week: %v after %d runs, want processed", res, h.runs)
	}
	d.ID, d.Sent = "msg-secret-id-2", time.Now().Add(-8*24*time.Hour)
	if res := c.Handle(t.Context(), msg{d: d, h: h.handle}); res.Outcome != consumer.Rejected || !errors.Is(res.Err, consumer.ErrExpired) {
		t.Fatalf("a message sent eight days ago, ids kept a week: %v, want rejected as expired", res)
	}
}
