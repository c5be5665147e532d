package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/sealtest"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store/postgres"
)

// numbered is the message n of partition, its place in the header "n".
func numbered(partition string, n int) outbox.Message {
	return outbox.Message{Destination: "orders", PartitionKey: partition,
		Headers: map[string]string{"n": strconv.Itoa(n)}, Payload: []byte(partition + "/" + strconv.Itoa(n))}
}

func place(m outbox.Message) int {
	n, _ := strconv.Atoi(m.Headers["n"])
	return n
}

// The relay sends in the order messages were written: a batch in that
// order, a partition's messages one after another and never two of one
// partition in a batch.
func TestRelayOrder(t *testing.T) {
	r := newRig(t)
	const partitions, each = 5, 12
	n := 0
	for range each {
		var ms []outbox.Message
		for p := range partitions {
			n++
			ms = append(ms, numbered("p"+strconv.Itoa(p), n))
		}
		r.publish(t, ms[:2]...)
		r.publish(t, ms[2:]...)
	}
	var pub recorder
	start(t, r.relay(t, r.ob, &pub, outbox.WithBatch(4)))
	waitFor(t, "every message sent", func() bool { return len(pub.sent()) >= partitions*each })

	last := map[string]int{}
	seen := map[string]bool{}
	for i, b := range pub.allBatches() {
		inBatch := map[string]bool{}
		for j, m := range b {
			if inBatch[m.PartitionKey] {
				t.Errorf("batch %d holds two messages of partition %s", i, m.PartitionKey)
			}
			inBatch[m.PartitionKey] = true
			if j > 0 && place(m) < place(b[j-1]) {
				t.Errorf("batch %d: message %d after %d", i, place(m), place(b[j-1]))
			}
			if place(m) < last[m.PartitionKey] {
				t.Errorf("partition %s: message %d sent after %d", m.PartitionKey, place(m), last[m.PartitionKey])
			}
			last[m.PartitionKey] = place(m)
			if seen[m.ID] {
				t.Errorf("message %d sent twice", place(m))
			}
			seen[m.ID] = true
		}
	}
	if len(seen) != partitions*each {
		t.Errorf("%d messages sent, want %d", len(seen), partitions*each)
	}

	// Messages each of its own partition go in the order written.
	r2 := newRig(t)
	for i := range 20 {
		r2.publish(t, numbered("", i+1))
	}
	var pub2 recorder
	start(t, r2.relay(t, r2.ob, &pub2, outbox.WithBatch(7)))
	waitFor(t, "every message sent", func() bool { return len(pub2.sent()) >= 20 })
	for i, m := range pub2.sent() {
		if place(m) != i+1 {
			t.Fatalf("sent %d: message %d, want %d", i, place(m), i+1)
		}
	}
}

// A message the broker refuses is not marked sent, is tried again after a
// backoff until the broker confirms it, and holds back only its own
// partition's next messages.
func TestRelayRetriesFailedMessage(t *testing.T) {
	r := newRig(t)
	r.publish(t, numbered("a", 1), numbered("a", 2))
	r.publish(t, numbered("b", 3), numbered("b", 4), numbered("b", 5))
	var pub recorder
	var refusals atomic.Int32
	pub.setFn(func(_ context.Context, ms []outbox.Message) []error {
		errs := make([]error, len(ms))
		for i, m := range ms {
			if place(m) == 1 {
				refusals.Add(1)
				errs[i] = errors.New("broker refused the message")
			}
		}
		return errs
	})
	start(t, r.relay(t, r.ob, &pub))
	waitFor(t, "b's messages sent and a's first refused three times", func() bool {
		return refusals.Load() >= 3 && r.count(t, `SELECT count(*) FROM `+outboxTable+` WHERE sent_at IS NOT NULL`) == 3
	})
	for _, x := range r.rows(t) {
		n := place(decodeRow(t, x))
		switch {
		case n == 1 && (x.Sent || x.Attempts < 3):
			t.Errorf("the refused message: sent %v after %d attempts", x.Sent, x.Attempts)
		case n == 2 && (x.Sent || x.Attempts != 0):
			t.Errorf("the refused message's next: sent %v after %d attempts, want held back", x.Sent, x.Attempts)
		case n >= 3 && !x.Sent:
			t.Errorf("message %d of another partition: not sent", n)
		}
	}
	pub.setFn(nil)
	waitFor(t, "all five sent", func() bool { return len(pub.sent()) >= 5 })
	var order []int
	for _, m := range pub.sent() {
		order = append(order, place(m))
	}
	if got := fmt.Sprint(order[3:]); got != "[1 2]" {
		t.Errorf("sent in the order %v, want a's 1 then 2 last", order)
	}
	if log := r.log.String(); !strings.Contains(log, "messages were not sent") || strings.Contains(log, "a/1") {
		t.Errorf("the refusal is not logged, or its log quotes the payload:\n%s", log)
	}
}

// decodeRow reads an unsealed row's header "n" back, through a message.
func decodeRow(t *testing.T, x row) outbox.Message {
	t.Helper()
	var m outbox.Message
	if err := outbox.Decode(x.Body, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// A sealed outbox stores no payload in the clear, and its relay opens and
// sends it whole; a relay whose outbox has no sealer refuses it, logs it,
// and leaves it pending.
func TestRelaySealed(t *testing.T) {
	r := newRig(t, outbox.WithSealer(sealtest.Ring(t, 7)))
	const secret = "card-4242-secret"
	m := outbox.Message{Destination: "payments.charge.created", Headers: map[string]string{"h": secret + "-header"}, Payload: []byte(secret)}
	r.publish(t, m)
	rows := r.rows(t)
	if len(rows) != 1 || bytes.Contains(rows[0].Body, []byte(secret)) {
		t.Fatalf("the sealed outbox holds %d rows, the first's body in the clear: %q", len(rows), rows[0].Body)
	}

	// A relay without the sealer first: it must not send.
	plain, err := outbox.New(r.st)
	if err != nil {
		t.Fatal(err)
	}
	var refused recorder
	stop := start(t, r.relay(t, plain, &refused))
	waitFor(t, "the sealed message refused and logged", func() bool {
		return strings.Contains(r.log.String(), "does not open") && r.rows(t)[0].Attempts >= 2
	})
	stop()
	if n := len(refused.sent()); n != 0 {
		t.Fatalf("a relay without the sealer sent %d messages", n)
	}
	if x := r.rows(t)[0]; x.Sent {
		t.Fatal("a message that did not open is marked sent")
	}
	if strings.Contains(r.log.String(), secret) {
		t.Errorf("the log quotes the payload:\n%s", r.log)
	}

	var pub recorder
	start(t, r.relay(t, r.ob, &pub))
	waitFor(t, "the sealed message sent", func() bool { return len(pub.sent()) == 1 })
	got := pub.sent()[0]
	if string(got.Payload) != secret || got.Headers["h"] != secret+"-header" || got.ID != rows[0].ID {
		t.Errorf("sent %+v, want %+v", got, m)
	}
	waitFor(t, "marked sent", func() bool { return r.rows(t)[0].Sent })
}

// Two relays on one outbox send every one of 1,000 messages, and, as
// neither dies, none twice.
func TestTwoRelays(t *testing.T) {
	r := newRig(t)
	var a, b recorder
	start(t, r.relay(t, r.ob, &a, outbox.WithBatch(25)))
	start(t, r.relay(t, r.ob, &b, outbox.WithBatch(25)))
	const total = 1000
	for i := range total / 50 {
		ms := make([]outbox.Message, 50)
		for j := range ms {
			ms[j] = numbered("", i*50+j+1)
		}
		r.publish(t, ms...)
	}
	waitFor(t, "every message sent", func() bool {
		return r.count(t, `SELECT count(*) FROM `+outboxTable+` WHERE sent_at IS NOT NULL`) == total
	})
	times := map[string]int{}
	for _, m := range append(a.sent(), b.sent()...) {
		times[m.ID]++
	}
	twice := 0
	for _, n := range times {
		twice += n - 1
	}
	t.Logf("relay a sent %d, relay b %d; %d messages sent more than once", len(a.sent()), len(b.sent()), twice)
	if len(times) != total || twice != 0 {
		t.Errorf("%d messages sent, %d of them more than once: want %d, none twice", len(times), twice, total)
	}
}

// A relay killed while its broker holds a batch leaves the batch claimed;
// once its lease has ended, another relay sends it: no message is lost.
func TestKilledRelayMessagesSentByAnother(t *testing.T) {
	r := newRig(t)
	const total = 30
	for i := range total {
		r.publish(t, numbered("", i+1))
	}

	// The relay to kill has a pool of its own, which the kill closes, so
	// that it writes nothing after its broker's answer: as if its process
	// died in the publish.
	pool := pgtest.Pool(t, r.schema)
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(st)
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan []outbox.Message, 1), make(chan struct{})
	var killed recorder
	killed.setFn(func(_ context.Context, ms []outbox.Message) []error {
		entered <- ms
		<-release
		return refuse(ms)
	})
	stopKilled := start(t, r.relay(t, ob, &killed, outbox.WithBatch(10), outbox.WithLease(2*time.Second)))
	var held []outbox.Message
	select {
	case held = <-entered:
	case <-time.After(wait):
		t.Fatal("the relay never published")
	}
	pool.Close()
	close(release)
	stopKilled()

	var other recorder
	start(t, r.relay(t, r.ob, &other))
	waitFor(t, "every message sent by the other relay", func() bool {
		return r.count(t, `SELECT count(*) FROM `+outboxTable+` WHERE sent_at IS NOT NULL`) == total
	})
	sent := map[string]bool{}
	for _, m := range other.sent() {
		sent[m.ID] = true
	}
	if len(sent) != total {
		t.Errorf("the other relay sent %d messages, want all %d", len(sent), total)
	}
	for _, m := range held {
		if !sent[m.ID] {
			t.Errorf("message %d, held by the killed relay, was never sent", place(m))
		}
	}
	if len(held) != 10 {
		t.Errorf("the killed relay held %d messages, want a batch of 10", len(held))
	}
	t.Logf("the killed relay held %d messages; the other relay sent %d", len(held), len(sent))
}

// WithRate bounds the messages a second: no claim sends more than a tenth
// of a second's, and the whole takes at least as long as the rate allows.
// Only a lower bound is checked, which a slow machine cannot break.
func TestRelayRate(t *testing.T) {
	r := newRig(t)
	const total, rate = 200, 200.0
	for i := range total / 50 {
		ms := make([]outbox.Message, 50)
		for j := range ms {
			ms[j] = numbered("", i*50+j+1)
		}
		r.publish(t, ms...)
	}
	var pub recorder
	began := time.Now()
	start(t, r.relay(t, r.ob, &pub, outbox.WithRate(rate)))
	waitFor(t, "every message sent", func() bool { return len(pub.sent()) >= total })
	took := time.Since(began)
	limit := int(rate / 10)
	for i, b := range pub.allBatches() {
		if len(b) > limit {
			t.Errorf("batch %d sent %d messages, more than the rate's %d a tenth of a second", i, len(b), limit)
		}
	}
	// The first claim goes at once, each next after the last's share of a
	// second.
	least := time.Duration(float64(total-limit) / rate * float64(time.Second))
	t.Logf("%d messages at %v a second took %v (at least %v)", total, rate, took, least)
	if took < least*9/10 {
		t.Errorf("%d messages at %v a second took %v, less than %v", total, rate, took, least*9/10)
	}
}

// The metrics: pending messages and the oldest's age while the broker
// refuses them, the failed sends, then the sent ones.
func TestRelayMetrics(t *testing.T) {
	r := newRig(t)
	r.publish(t, numbered("", 1), numbered("", 2), numbered("", 3))
	if _, err := r.pool.Exec(t.Context(), `UPDATE `+outboxTable+` SET created_at = now() - interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	var pub recorder
	pub.setFn(func(_ context.Context, ms []outbox.Message) []error { return refuse(ms) })
	start(t, r.relay(t, r.ob, &pub, outbox.WithMeterProvider(mp)))

	read := func() map[string]float64 {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch d := m.Data.(type) {
				case metricdata.Sum[int64]:
					for _, dp := range d.DataPoints {
						got[m.Name] += float64(dp.Value)
					}
				case metricdata.Gauge[int64]:
					for _, dp := range d.DataPoints {
						got[m.Name] = float64(dp.Value)
					}
				case metricdata.Gauge[float64]:
					for _, dp := range d.DataPoints {
						got[m.Name] = dp.Value
					}
				}
			}
		}
		return got
	}
	var got map[string]float64
	waitFor(t, "3 pending, an hour old, refused", func() bool {
		got = read()
		return got["idemkey.outbox.pending"] == 3 && got["idemkey.outbox.oldest_age"] >= 3600 && got["idemkey.outbox.failed"] >= 3
	})
	if got["idemkey.outbox.sent"] != 0 {
		t.Errorf("sent %v while the broker refused all", got["idemkey.outbox.sent"])
	}
	pub.setFn(nil)
	waitFor(t, "none pending, 3 sent", func() bool {
		got = read()
		return got["idemkey.outbox.pending"] == 0 && got["idemkey.outbox.oldest_age"] == 0 && got["idemkey.outbox.sent"] == 3
	})
}

// The relay sweeps the messages sent longer ago than the retention, and
// keeps those sent since.
func TestRelaySweepsSent(t *testing.T) {
	r := newRig(t)
	r.publish(t, numbered("", 1), numbered("", 2))
	if _, err := r.pool.Exec(t.Context(), `UPDATE `+outboxTable+` SET sent_at = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	r.publish(t, numbered("", 3))
	var pub recorder
	start(t, r.relay(t, r.ob, &pub, outbox.WithRetention(time.Hour)))
	waitFor(t, "the old messages swept, the new one sent", func() bool {
		rows := r.rows(t)
		return len(rows) == 1 && rows[0].Sent
	})
	if place(decodeRow(t, r.rows(t)[0])) != 3 {
		t.Error("the message kept is not the one sent now")
	}
	if n := len(pub.sent()); n != 1 {
		t.Errorf("%d messages sent, want 1: those already sent are not sent again", n)
	}
}

// The relay refuses options that make no sense.
func TestRelayRefusesOptions(t *testing.T) {
	r := newRig(t)
	var pub recorder
	for name, opt := range map[string]outbox.RelayOption{
		"batch":     outbox.WithBatch(0),
		"lease":     outbox.WithLease(time.Millisecond),
		"rate":      outbox.WithRate(-1),
		"retention": outbox.WithRetention(-time.Second),
		"poll":      outbox.WithPollInterval(0),
	} {
		if _, err := r.ob.Relay(&pub, opt); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := r.ob.Relay(nil); err == nil {
		t.Error("a nil Publisher: accepted")
	}
}

// A relay that answers after its lease ended, and another relay claimed
// the message since, cannot cut the other's claim short: its backoff
// (RetryMessages) holds only for the claim it made.
func TestLateRetryLeavesAnotherClaim(t *testing.T) {
	r := newRig(t)
	r.publish(t, numbered("", 1))
	ctx := t.Context()
	first, err := r.st.ClaimMessages(ctx, 10, 0) // a lease that has ended at once
	if err != nil || len(first) != 1 {
		t.Fatalf("first claim: %v, %v", first, err)
	}
	second, err := r.st.ClaimMessages(ctx, 10, time.Minute)
	if err != nil || len(second) != 1 || second[0].Attempts != first[0].Attempts+1 {
		t.Fatalf("second claim: %v, %v; want the message, claimed again", second, err)
	}
	if err := r.st.RetryMessages(ctx, first, 0); err != nil { // the first relay's late answer
		t.Fatal(err)
	}
	if third, err := r.st.ClaimMessages(ctx, 10, time.Minute); err != nil || len(third) != 0 {
		t.Errorf("a third claim got %d messages (%v): the late retry ended the second claim's lease", len(third), err)
	}
	if err := r.st.RetryMessages(ctx, second, 0); err != nil { // the holder's own
		t.Fatal(err)
	}
	if again, err := r.st.ClaimMessages(ctx, 10, time.Minute); err != nil || len(again) != 1 {
		t.Errorf("after the holder's retry, a claim got %d messages (%v), want 1", len(again), err)
	}
}
