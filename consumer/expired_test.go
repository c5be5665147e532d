package consumer_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/internal/logtest"
)

// TestExpired checks that a message sent longer ago than the retention is
// dead-lettered without running when its id has no record, one at a time
// and in a batch, and still dropped as a duplicate when it has one.
func TestExpired(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		h := &counter{}
		stale := func(id string) consumer.Delivery {
			d := delivery(id, 2)
			d.Sent = time.Now().Add(-consumer.RecommendedRetention - time.Minute)
			return d
		}
		res := c.handle(t.Context(), stale("msg-secret-id"), h.handle)
		if res.Outcome != consumer.Rejected || res.Action != consumer.Reject || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrExpired) {
			t.Fatalf("a stale message: %+v, want refused, rejected and dead-lettered with ErrExpired", res)
		}
		recent := delivery("msg-secret-id", 1)
		recent.Sent = time.Now()
		if res := c.handle(t.Context(), recent, h.handle); res.Outcome != consumer.Processed {
			t.Fatalf("a recent delivery after the refusal: %+v, want processed", res)
		}
		if res := c.handle(t.Context(), stale("msg-secret-id"), h.handle); res.Outcome != consumer.Duplicate {
			t.Fatalf("a stale redelivery of a processed message: %+v, want a duplicate", res)
		}
		future := delivery("msg-future", 1)
		future.Sent = time.Now().Add(time.Hour) // a publisher's clock ahead
		if res := c.handle(t.Context(), future, h.handle); res.Outcome != consumer.Processed {
			t.Fatalf("a message stamped in the future: %+v, want processed", res)
		}

		ds := []consumer.Delivery{stale("msg-batch-stale"), delivery("msg-batch-new", 1), stale("msg-secret-id")}
		b := &batchCounter{ds: ds}
		results := c.handleBatch(t.Context(), ds, b.handle)
		wantOutcomes(t, "a batch", results, consumer.Rejected, consumer.Processed, consumer.Duplicate)
		if !errors.Is(results[0].Err, consumer.ErrExpired) || !results[0].DeadLetter {
			t.Errorf("the batch's stale message: %+v, want dead-lettered with ErrExpired", results[0])
		}
		if h.runs != 2 || len(b.runs) != 1 || b.runs[0] != "msg-batch-new" {
			t.Errorf("handlers ran %d times and for %q, want 2 times and for msg-batch-new", h.runs, b.runs)
		}
	})
}

// TestExpiredLogged: the refusal of a stale message is logged as what it
// is, with the message's age and the retention it outlived, so that an
// operator can tell it from the refusal of a malformed message; never with
// its id, tenant or body (each checks the logs).
func TestExpiredLogged(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, logs *logtest.Buffer) {
		d := delivery("msg-secret-id", 2)
		d.Sent = time.Now().Add(-consumer.RecommendedRetention - 2*time.Hour)
		if res := c.handle(t.Context(), d, (&counter{}).handle); !errors.Is(res.Err, consumer.ErrExpired) {
			t.Fatalf("a stale message: %+v, want refused with ErrExpired", res)
		}
		l := logs.String()
		for _, want := range []string{"message refused", consumer.ErrExpired.Error(), "age=170h", "retention=168h0m0s"} {
			if !strings.Contains(l, want) {
				t.Errorf("the log does not say %q:\n%s", want, l)
			}
		}
		if strings.Contains(l, "an error of type") {
			t.Errorf("the log hides the refusal's reason:\n%s", l)
		}
	})
}
