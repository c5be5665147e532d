package brokertest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// PublisherFeatures says what a broker does with what a Relay publishes
// that some cases check.
type PublisherFeatures struct {
	// DropsDuplicates is true when the broker drops a message whose id it
	// has (JetStream's duplicate window): a resend never reaches a
	// consumer. Elsewhere idemkey's consumer drops it.
	DropsDuplicates bool
}

// PublisherRig is a destination of a case's own on a broker (a stream's
// subject, a queue, a topic), its broker module's outbox.Publisher, and a
// consumer of the destination with the module's consumer.Broker.
type PublisherRig[M any] interface {
	// Publisher is the module's Publisher, which a case's Relay sends with.
	Publisher() outbox.Publisher
	// Destination is where the rig's messages go and are consumed from.
	Destination() string
	// Refused is a destination the broker refuses: no stream's subject, no
	// queue, no topic.
	Refused() string
	// Broker is the module's Broker of Destination's messages.
	Broker() consumer.Broker[M]
	// Headers returns a message's headers as the broker delivered them.
	Headers(m M) map[string]string
	// Consume hands each message to handle, one at a time, in the order of
	// each partition, until ctx ends.
	Consume(ctx context.Context, t *testing.T, handle func(M))
}

// NewPublisherRig builds a PublisherRig.
type NewPublisherRig[M any] func(t *testing.T) PublisherRig[M]

// RunPublisher runs every publisher case on newRig's broker: a Relay on a
// real PostgreSQL outbox sends through the rig's Publisher, and a consumer
// of the module's Broker, with no option on how it reads ids, receives.
func RunPublisher[M any](t *testing.T, f PublisherFeatures, newRig NewPublisherRig[M]) {
	t.Run("RelaySendsCommitted", func(t *testing.T) { relaySends(t, newRig) })
	t.Run("ResendDeliveredOnce", func(t *testing.T) { resendOnce(t, f, newRig) })
	t.Run("RefusedDestinationPending", func(t *testing.T) { refusedPending(t, newRig) })
}

// received is a message as a consumer got it.
type received struct {
	id      string
	body    string
	headers map[string]string
	outcome consumer.Outcome
}

// pubSession is a case's outbox, its relay, and the consumer of the rig's
// destination, running until the case ends.
type pubSession struct {
	t       *testing.T
	pool    *pgxpool.Pool
	st      *postgres.Store
	ob      *outbox.Outbox
	reader  *sdkmetric.ManualReader
	logs    *logtest.Buffer
	dest    string
	refused string

	mu   sync.Mutex
	got  []received // in the order handled
	runs map[string]int
}

// startPub starts a relay of a new outbox to newRig's Publisher, and a
// consumer of the rig's destination.
func startPub[M any](t *testing.T, newRig NewPublisherRig[M]) *pubSession {
	t.Helper()
	st, pool := pgStore(t)
	ob, err := outbox.New(st)
	if err != nil {
		t.Fatal(err)
	}
	rig := newRig(t)
	logger, logs := logtest.New()
	s := &pubSession{t: t, pool: pool, st: st, ob: ob, reader: sdkmetric.NewManualReader(), logs: logs,
		dest: rig.Destination(), refused: rig.Refused(), runs: map[string]int{}}
	relay, err := ob.Relay(rig.Publisher(), outbox.WithLogger(logger), outbox.WithPollInterval(50*time.Millisecond),
		outbox.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(s.reader))))
	if err != nil {
		t.Fatal(err)
	}
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	b := rig.Broker()
	c, err := consumer.New(eng, "receipts", b, func(ctx context.Context, m M) error {
		id, _ := b.ID(m)
		s.mu.Lock()
		defer s.mu.Unlock()
		s.runs[id]++
		return nil
	}, consumer.WithDiscardDeadLetters(), fast)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	var wg sync.WaitGroup
	wg.Go(func() { relay.Run(ctx) })
	wg.Go(func() {
		rig.Consume(ctx, t, func(m M) {
			res := c.Handle(ctx, m)
			id, _ := b.ID(m)
			d, _ := b.Read(m)
			s.mu.Lock()
			defer s.mu.Unlock()
			s.got = append(s.got, received{id: id, body: string(d.Body), headers: rig.Headers(m), outcome: res.Outcome})
		})
	})
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		if strings.Contains(logs.String(), "secret") {
			t.Errorf("the logs hold a message's payload or header:\n%s", logs)
		}
		if t.Failed() {
			t.Logf("received %v; logs:\n%s", s.received(), logs)
		}
	})
	return s
}

// write publishes ms through the outbox in a transaction, and commits it,
// or rolls it back.
func (s *pubSession) write(commit bool, ms ...outbox.Message) {
	s.t.Helper()
	ctx := s.t.Context()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		s.t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if err := s.ob.Publish(postgres.ContextWithTx(ctx, tx), ms...); err != nil {
		s.t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			s.t.Fatal(err)
		}
	}
}

func (s *pubSession) received() []received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.got)
}

func (s *pubSession) runsOf(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[id]
}

// waitFor waits until ok, for at most a minute, or fails.
func (s *pubSession) waitFor(what string, ok func() bool) {
	s.t.Helper()
	for deadline := time.Now().Add(time.Minute); !ok(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			s.t.Fatalf("%s: not within a minute", what)
		}
	}
}

// pending is the store's count of unsent messages.
func (s *pubSession) pending() int64 {
	s.t.Helper()
	n, _, err := s.st.PendingMessages(s.t.Context())
	if err != nil {
		s.t.Fatal(err)
	}
	return n
}

// counter is the relay's idemkey.outbox.<name> counter's sum.
func (s *pubSession) counter(name string) int64 {
	s.t.Helper()
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(s.t.Context(), &rm); err != nil {
		s.t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "idemkey.outbox."+name {
				var n int64
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
				return n
			}
		}
	}
	return 0
}

// message is the nth of a case's messages to dest, of partition key pk.
func message(dest, pk string, n int) outbox.Message {
	return outbox.Message{ID: fmt.Sprintf("m%d-%s", n, pk), Destination: dest, PartitionKey: pk,
		Headers: map[string]string{"trace": secret("trace", n)}, Payload: []byte(secret("body", n))}
}

// relaySends: the messages of committed transactions arrive once each, with
// their id (read by the consumer's default), headers and payload, each
// partition key's in the order written; a rolled-back one never does.
func relaySends[M any](t *testing.T, newRig NewPublisherRig[M]) {
	s := startPub(t, newRig)
	s.write(false, message(s.dest, "rolled-back", 0))
	pks := []string{"charge-a", "charge-b", "charge-c"}
	var want []outbox.Message
	for n := 1; n <= 4; n++ {
		var ms []outbox.Message
		for _, pk := range pks {
			ms = append(ms, message(s.dest, pk, n))
		}
		s.write(true, ms...)
		want = append(want, ms...)
	}
	s.waitFor("all sent and received", func() bool { return len(s.received()) >= len(want) && s.pending() == 0 })
	got := s.received()
	if len(got) != len(want) {
		t.Fatalf("received %d messages, want %d", len(got), len(want))
	}
	byID := map[string]received{}
	order := map[string][]string{} // partition key: ids in the order received
	for _, r := range got {
		if _, dup := byID[r.id]; dup {
			t.Errorf("message %s received twice", r.id)
		}
		byID[r.id] = r
		pk := r.id[strings.Index(r.id, "-")+1:]
		order[pk] = append(order[pk], r.id)
	}
	for _, m := range want {
		r, ok := byID[m.ID]
		switch {
		case !ok:
			t.Errorf("message %s never arrived, or not with its id", m.ID)
		case r.outcome != consumer.Processed || s.runsOf(m.ID) != 1:
			t.Errorf("message %s: outcome %v, %d runs; want processed, once", m.ID, r.outcome, s.runsOf(m.ID))
		case r.body != string(m.Payload) || r.headers["trace"] != m.Headers["trace"]:
			t.Errorf("message %s arrived with another payload or trace header", m.ID)
		}
	}
	for _, pk := range pks {
		var ids []string
		for _, m := range want {
			if m.PartitionKey == pk {
				ids = append(ids, m.ID)
			}
		}
		if !slices.Equal(order[pk], ids) {
			t.Errorf("partition key %s's messages arrived in the order %v, want %v", pk, order[pk], ids)
		}
	}
	if _, ok := byID[message(s.dest, "rolled-back", 0).ID]; ok {
		t.Error("a rolled-back message arrived")
	}
	if n := s.counter("sent"); n != int64(len(want)) {
		t.Errorf("idemkey.outbox.sent is %d, want %d", n, len(want))
	}
}

// resendOnce: a message the relay sends again (its sent mark lost) runs the
// consumer's handler once: the broker drops the resend, or idemkey's
// consumer does.
func resendOnce[M any](t *testing.T, f PublisherFeatures, newRig NewPublisherRig[M]) {
	s := startPub(t, newRig)
	first := message(s.dest, "charge-a", 1)
	s.write(true, first)
	s.waitFor("received", func() bool { return s.runsOf(first.ID) == 1 && s.pending() == 0 })
	// As if the relay died after the broker confirmed, before it marked
	// the message sent, and its lease had ended.
	if _, err := s.pool.Exec(t.Context(), `UPDATE idempotency_keys_outbox SET sent_at = NULL, not_before = now() WHERE id = $1`, first.ID); err != nil {
		t.Fatal(err)
	}
	s.waitFor("sent again", func() bool { return s.counter("sent") == 2 && s.pending() == 0 })
	// The next of its partition arrives after the resend, if it does.
	next := message(s.dest, "charge-a", 2)
	s.write(true, next)
	s.waitFor("the next received", func() bool { return s.runsOf(next.ID) == 1 })
	var deliveries int
	var outcomes []consumer.Outcome
	for _, r := range s.received() {
		if r.id == first.ID {
			deliveries++
			outcomes = append(outcomes, r.outcome)
		}
	}
	if n := s.runsOf(first.ID); n != 1 {
		t.Fatalf("the handler ran %d times for the message sent twice, want 1", n)
	}
	want := []consumer.Outcome{consumer.Processed, consumer.Duplicate}
	if f.DropsDuplicates {
		want = want[:1]
	}
	if !slices.Equal(outcomes, want) {
		t.Fatalf("the message sent twice was delivered %d times, with outcomes %v; want %v", deliveries, outcomes, want)
	}
}

// refusedPending: a message to a destination the broker refuses fails on
// its own and stays pending, counted as failed and logged; the others of
// its batch are sent.
func refusedPending[M any](t *testing.T, newRig NewPublisherRig[M]) {
	s := startPub(t, newRig)
	refused := message(s.refused, "charge-r", 1)
	ok := []outbox.Message{message(s.dest, "charge-a", 2), message(s.dest, "charge-b", 3)}
	s.write(true, append([]outbox.Message{refused}, ok...)...)
	s.waitFor("the others received, the refused one failed", func() bool {
		return s.runsOf(ok[0].ID) == 1 && s.runsOf(ok[1].ID) == 1 && s.counter("failed") >= 1 && s.counter("sent") == 2
	})
	if n := s.pending(); n != 1 {
		t.Fatalf("%d messages pending, want the refused one", n)
	}
	if n := len(s.received()); n != 2 {
		t.Fatalf("received %d messages, want 2", n)
	}
	if !strings.Contains(s.logs.String(), "messages were not sent") || !strings.Contains(s.logs.String(), refused.ID) {
		t.Fatalf("the refused message's failure was not logged by its id:\n%s", s.logs)
	}
}
