package idemnats_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/natstest"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// fast keeps redeliveries quick in tests.
var fast = consumer.WithBackoff(20*time.Millisecond, 100*time.Millisecond)

// bounded is a consumer whose redelivery horizon (20 deliveries of a
// second's ack wait, or a nak's backoff) is far shorter than any retention.
func bounded(name string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: 20}
}

// rig is one stream with one durable consumer, processed by a consumer on
// idemnats's Broker whose handler counts its runs by message id.
type rig struct {
	t      *testing.T
	js     jetstream.JetStream
	stream jetstream.Stream
	cons   jetstream.Consumer
	c      *consumer.Consumer[jetstream.Msg]

	mu      sync.Mutex
	runs    map[string]int
	results map[consumer.Outcome]int
	dead    []error
}

// newEngine is an engine on st with the retention consumers are given,
// then eopts.
func newEngine(t *testing.T, st store.Store, eopts ...engine.Option) *engine.Engine {
	t.Helper()
	eng, err := engine.New(st, append([]engine.Option{engine.WithRetention(consumer.RecommendedRetention)}, eopts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return eng
}

// newBroker is idemnats's Broker of cons, a consumer of stream.
func newBroker(t *testing.T, stream jetstream.Stream, cons jetstream.Consumer) consumer.Broker[jetstream.Msg] {
	t.Helper()
	b, err := idemnats.New(t.Context(), stream, cons)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ok is a handler that succeeds.
func ok(context.Context, jetstream.Msg) error { return nil }

// newRig is a rig on st, whose engine has eopts, and whose consumer has a
// dead-letter hook that keeps what it is given, then opts.
func newRig(t *testing.T, js jetstream.JetStream, st store.Store, h func(context.Context, jetstream.Msg) error, eopts []engine.Option, opts ...consumer.Option) *rig {
	t.Helper()
	return newWrappedRig(t, js, st, h, nil, eopts, opts...)
}

// newWrappedRig is newRig, whose consumer reads and settles its messages
// through wrap of idemnats's Broker, if wrap is not nil.
func newWrappedRig(t *testing.T, js jetstream.JetStream, st store.Store, h func(context.Context, jetstream.Msg) error,
	wrap func(consumer.Broker[jetstream.Msg]) consumer.Broker[jetstream.Msg], eopts []engine.Option, opts ...consumer.Option) *rig {
	t.Helper()
	stream := natstest.Stream(t, js, jetstream.StreamConfig{Duplicates: 100 * time.Millisecond})
	name := natstest.Name("c")
	cons, err := stream.CreateConsumer(t.Context(), bounded(name))
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, js: js, stream: stream, cons: cons, runs: map[string]int{}, results: map[consumer.Outcome]int{}}
	counted := func(ctx context.Context, msg jetstream.Msg) error {
		r.mu.Lock()
		r.runs[msg.Headers().Get(jetstream.MsgIDHeader)]++
		r.mu.Unlock()
		if h == nil {
			return nil
		}
		return h(ctx, msg)
	}
	keep := consumer.WithDeadLetter(func(_ context.Context, _ jetstream.Msg, err error) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.dead = append(r.dead, err)
		return nil
	})
	b := newBroker(t, stream, cons)
	if wrap != nil {
		b = wrap(b)
	}
	r.c, err = consumer.New(newEngine(t, st, eopts...), name, b, counted, append([]consumer.Option{fast, keep}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *rig) subject() string { return r.stream.CachedInfo().Config.Name + ".charges" }

// publish publishes body with id (none if empty) and extra headers.
func (r *rig) publish(id, body string, headers ...string) {
	r.t.Helper()
	msg := nats.NewMsg(r.subject())
	msg.Data = []byte(body)
	if id != "" {
		msg.Header.Set(jetstream.MsgIDHeader, id)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		msg.Header.Add(headers[i], headers[i+1])
	}
	// A resend that JetStream still finds within its duplicate window (the
	// tests sleep past it, but a loaded machine may purge late) is sent
	// again, so that the consumer gets it.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ack, err := r.js.PublishMsg(r.t.Context(), msg)
		if err != nil {
			r.t.Fatal(err)
		}
		if !ack.Duplicate {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatal("JetStream kept the message for a duplicate past its window")
		}
	}
}

// consume runs the consumer until want messages were handled with an
// outcome that ends them (acknowledged or terminated), or fails.
func (r *rig) consume(want int) {
	r.t.Helper()
	done := make(chan struct{})
	var once sync.Once
	ended := 0
	cc, err := r.cons.Consume(func(msg jetstream.Msg) {
		res := r.c.Handle(context.Background(), msg)
		r.mu.Lock()
		defer r.mu.Unlock()
		r.results[res.Outcome]++
		if res.Action != consumer.Nak {
			if ended++; ended == want {
				once.Do(func() { close(done) })
			}
		}
	})
	if err != nil {
		r.t.Fatal(err)
	}
	defer cc.Stop()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		r.mu.Lock()
		defer r.mu.Unlock()
		r.t.Fatalf("only %d of %d messages ended: outcomes %v", ended, want, r.results)
	}
	cc.Stop()
	<-cc.Closed()
}

// settled fails unless the consumer has nothing pending or unacknowledged.
func (r *rig) settled() {
	r.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		info, err := r.cons.Info(r.t.Context())
		if err != nil {
			r.t.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0 {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("consumer not settled: %d pending, %d unacknowledged, %d redelivered", info.NumPending, info.NumAckPending, info.NumRedelivered)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *rig) runsOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[id]
}

func (r *rig) outcomes() map[consumer.Outcome]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.results
}

// TestRefusedMessagesTerminated: a message without an id, without a tenant,
// or with a tenant's id and another body is refused. The ids are the
// tenants' own, in the header "order-id" (WithMessageID), so that JetStream,
// which deduplicates Nats-Msg-Id across tenants, drops none of them: one id
// of two tenants is two messages.
func TestRefusedMessagesTerminated(t *testing.T) {
	_, js := natstest.Connect(t)
	tenants := consumer.WithMessageTenant(func(msg jetstream.Msg) (string, error) {
		if tn := msg.Headers().Get("tenant"); tn == "acme" || tn == "globex" {
			return tn, nil
		}
		return "", errors.New("unknown tenant")
	})
	orderID := consumer.WithMessageID(func(msg jetstream.Msg) (string, error) {
		if v := msg.Headers().Values("order-id"); len(v) == 1 {
			return v[0], nil
		}
		return "", fmt.Errorf("%w: no order-id header", consumer.ErrNoID)
	})
	r := newRig(t, js, memory.New(), nil, nil, tenants, orderID)
	r.publish("", "no id", "tenant", "acme")
	r.publish("", "no tenant", "order-id", "x")
	r.publish("", "first body", "order-id", "a", "tenant", "acme")
	r.publish("", "same id, other tenant", "order-id", "a", "tenant", "globex")
	r.consume(4)
	r.publish("", "same id, other body", "order-id", "a", "tenant", "acme")
	r.consume(1)
	if got := r.outcomes(); got[consumer.Rejected] != 3 || got[consumer.Processed] != 2 {
		t.Fatalf("outcomes %v, want 3 rejected (no id, no tenant, reused id) and 2 processed", got)
	}
	if len(r.dead) != 3 || !errors.Is(r.dead[0], consumer.ErrNoID) || !errors.Is(r.dead[2], consumer.ErrReusedID) {
		t.Fatalf("dead letters %v", r.dead)
	}
	r.settled()
}

// TestRedeliveryWhileRunning: a handler outlasts the ack wait, so JetStream
// redelivers its message to another worker; that one finds it in progress
// and delays it, then drops it once the first run is recorded.
func TestRedeliveryWhileRunning(t *testing.T) {
	_, js := natstest.Connect(t)
	var once sync.Once
	r := newRig(t, js, memory.New(), func(context.Context, jetstream.Msg) error {
		once.Do(func() { time.Sleep(2500 * time.Millisecond) }) // more than twice the ack wait
		return nil
	}, nil)
	r.publish("a", "charge")
	var wg sync.WaitGroup
	results := make(chan consumer.Result, 100)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	for range 2 { // two workers on one durable consumer
		wg.Go(func() {
			for ctx.Err() == nil {
				batch, err := r.cons.Fetch(1, jetstream.FetchMaxWait(200*time.Millisecond))
				if err != nil {
					continue
				}
				for msg := range batch.Messages() {
					results <- r.c.Handle(ctx, msg)
				}
			}
		})
	}
	// Stop once the first run ended and JetStream holds nothing more.
	for ctx.Err() == nil {
		time.Sleep(100 * time.Millisecond)
		info, err := r.cons.Info(ctx)
		if err == nil && r.runsOf("a") == 1 && len(results) > 0 && info.NumAckPending == 0 && info.NumPending == 0 {
			cancel()
		}
	}
	wg.Wait()
	close(results)
	got := map[consumer.Outcome]int{}
	for res := range results {
		got[res.Outcome]++
	}
	if r.runsOf("a") != 1 {
		t.Fatalf("handler ran %d times, want 1", r.runsOf("a"))
	}
	// The first run's acknowledgement may settle the message before a
	// delayed redelivery comes back as a duplicate.
	if got[consumer.Processed] != 1 || got[consumer.Busy] == 0 {
		t.Fatalf("outcomes %v, want one processed, and redeliveries delayed as busy", got)
	}
	r.settled()
}

// TestBrokerRestartMidStream: the broker is killed and restarted while
// messages are processed; every message is processed exactly once.
func TestBrokerRestartMidStream(t *testing.T) {
	srv := natstest.Start(t)
	nc, js := srv.Connect(t)
	r := newRig(t, js, memory.New(), func(context.Context, jetstream.Msg) error {
		time.Sleep(2 * time.Millisecond)
		return nil
	}, nil)
	const n = 300
	for i := range n {
		r.publish(fmt.Sprint(i), fmt.Sprint("charge ", i))
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	seen := make(chan struct{}, 10*n)
	cc, err := r.cons.Consume(func(msg jetstream.Msg) {
		if res := r.c.Handle(ctx, msg); res.Action == consumer.Ack {
			seen <- struct{}{}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Stop()
	for range n / 3 {
		<-seen
	}
	srv.Kill()
	time.Sleep(300 * time.Millisecond)
	srv.Restart(t)
	deadline := time.After(60 * time.Second)
	for {
		info, err := r.cons.Info(ctx)
		if err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("not settled after the restart: %+v (%v), connected %v", info, err, nc.IsConnected())
		case <-time.After(100 * time.Millisecond):
		}
	}
	cc.Stop()
	<-cc.Closed()
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range n {
		if got := r.runs[fmt.Sprint(i)]; got != 1 {
			t.Fatalf("message %d ran %d times, want 1", i, got)
		}
	}
}

// TestNewChecksHorizon: a consumer JetStream may redeliver from forever is
// refused unless the operator accepts it; one within the retention is not.
// consumer.New refuses, from what idemnats's Broker read of the stream and
// the consumer; idemnats.New, which reads them, does not.
func TestNewChecksHorizon(t *testing.T) {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{})
	cons, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{Durable: "d", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	b := newBroker(t, stream, cons)
	discard := consumer.WithDiscardDeadLetters()
	_, err = consumer.New(newEngine(t, memory.New()), "d", b, ok, discard)
	var herr *consumer.HorizonError
	if !errors.As(err, &herr) || !herr.Horizon.Unbounded {
		t.Fatalf("New on an unbounded consumer: %v, want a HorizonError", err)
	}
	if _, err := consumer.New(newEngine(t, memory.New(), engine.WithLogger(nil)), "d", b, ok, discard, consumer.WithHorizonWarning()); err != nil {
		t.Fatalf("New with WithHorizonWarning: %v", err)
	}
	short, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{Durable: "e", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 100, AckWait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	eng := newEngine(t, memory.New(), engine.WithRetention(time.Hour))
	if _, err := consumer.New(eng, "d", newBroker(t, stream, short), ok, discard); !errors.As(err, &herr) || herr.Horizon.Bound != 100*time.Minute {
		t.Fatalf("New with 1h retention on a 100-minute horizon: %v, want a HorizonError", err)
	}
}

// TestNewRefusesImplicitAck: idemnats.New refuses a consumer that does not
// acknowledge explicitly: JetStream would not redeliver what a worker did
// not finish.
func TestNewRefusesImplicitAck(t *testing.T) {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	name := natstest.Name("c")
	cons, err := stream.CreateConsumer(t.Context(), jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idemnats.New(t.Context(), stream, cons); err == nil || !strings.Contains(err.Error(), "AckExplicitPolicy") {
		t.Fatalf("idemnats.New on a consumer without acknowledgements: %v, want a refusal that names AckExplicitPolicy", err)
	}
}
