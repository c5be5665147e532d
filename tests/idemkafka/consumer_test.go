package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

func TestFinalFailureRecordedAndDeadLettered(t *testing.T) {
	declined := status.Error(codes.FailedPrecondition, "card declined")
	r := newRig(t, memory.New(), func(context.Context, *kgo.Record) error { return declined }, nil, nil)
	r.publish("a", "charge")
	r.publish("a", "charge")
	r.consume(2)
	if n := r.runsOf("a"); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	if got := r.outcomes(); got[consumer.Failed] != 1 || got[consumer.Duplicate] != 1 {
		t.Fatalf("outcomes %v, want 1 failed and 1 duplicate", got)
	}
	if dead := r.deadLetters(); len(dead) != 2 || !errors.Is(dead[0], declined) || !errors.Is(dead[1], consumer.ErrFailedBefore) {
		t.Fatalf("dead letters %v, want the failure, then its resend", dead)
	}
	r.settled()
}

// A record that keeps failing for now is dead-lettered on its last attempt
// (WithMaxAttempts), to the dead-letter topic, with the cause in its
// headers in idemkey's words, and committed: never skipped in silence. A
// record refused (no id) and one failed for good go there too.
func TestMaxAttemptsToDeadLetterTopic(t *testing.T) {
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, brokers, "charges", 1, nil)
	dlq := kafkatest.Topic(t, brokers, "charges-dlq", 1, nil)
	group := kafkatest.Name("g")
	cl := kafkatest.GroupClient(t, brokers, group, []string{topic})
	var mu sync.Mutex
	runs := 0
	c := mustConsumer(t, memory.New(), group, cl,
		func(_ context.Context, rec *kgo.Record) error {
			mu.Lock()
			defer mu.Unlock()
			runs++
			if string(rec.Value) == "declined secret-body" {
				return status.Error(codes.FailedPrecondition, "declined secret-body")
			}
			return errors.New("ledger unreachable for secret-id")
		}, []engine.Option{engine.WithLogger(nil)},
		[]consumer.Option{fast, consumer.WithDeadLetter(idemkafka.DeadLetterTopic(cl, dlq))}, idemkafka.WithMaxAttempts(3))
	prod := kafkatest.Client(t, brokers)
	for _, rec := range []*kgo.Record{
		{Topic: topic, Value: []byte("charge"), Key: []byte("k1"), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("secret-id")}}},
		{Topic: topic, Value: []byte("no id")},
		{Topic: topic, Value: []byte("declined secret-body"), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("secret-id-2")}}},
	} {
		if err := prod.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var results []consumer.Result
	for len(results) < 3 {
		rs, err := idemkafka.NextBatch(ctx, cl, 10, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, rec := range rs {
			results = append(results, c.Handle(ctx, rec))
		}
		cl.AllowRebalance()
	}
	if res := results[0]; res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrLastDelivery) {
		t.Fatalf("the failing record: %+v, want it dead-lettered on its last attempt", res)
	}
	if results[1].Outcome != consumer.Rejected || results[2].Outcome != consumer.Failed {
		t.Fatalf("outcomes %v, %v; want rejected and failed", results[1], results[2])
	}
	if runs != 4 {
		t.Fatalf("%d runs, want 3 attempts of the first record and 1 of the declined one", runs)
	}
	settled(t, brokers, group, topic)

	// The dead letters, read back from their topic.
	reader := kafkatest.Client(t, brokers, kgo.ConsumeTopics(dlq), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	var dead []*kgo.Record
	for len(dead) < 3 {
		fs := reader.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("%d dead letters read, want 3: %v", len(dead), err)
		}
		dead = append(dead, fs.Records()...)
	}
	want := []struct{ value, cause string }{
		{"charge", "idemkey/consumer: the message's last delivery did not process it: an error of type *errors.errorString"},
		{"no id", "idemkey/consumer: the message has no id"},
		{"declined secret-body", "the handler's gRPC status FailedPrecondition"},
	}
	for i, d := range dead {
		h := map[string]string{}
		for _, kv := range d.Headers {
			h[kv.Key] = string(kv.Value)
		}
		if string(d.Value) != want[i].value || !strings.HasPrefix(h["idemkey-error"], want[i].cause) ||
			h["idemkey-topic"] != topic || h["idemkey-partition"] != "0" || h["idemkey-offset"] != fmt.Sprint(i) {
			t.Errorf("dead letter %d: %q with headers %v; want %q, cause %q, at %s/0/%d", i, d.Value, h, want[i].value, want[i].cause, topic, i)
		}
		if strings.Contains(h["idemkey-error"], "secret") {
			t.Errorf("dead letter %d's cause %q quotes the record", i, h["idemkey-error"])
		}
	}
	if string(dead[0].Key) != "k1" || dead[0].Headers[0].Key != "message-id" {
		t.Errorf("the first dead letter lost the record's key or headers: %q %v", dead[0].Key, dead[0].Headers)
	}
}

// A record without an id, without a tenant, or with a tenant's id and
// another body is refused; one id of two tenants is two messages.
func TestRefusedRecords(t *testing.T) {
	tenants := consumer.WithMessageTenant(func(rec *kgo.Record) (string, error) {
		for _, h := range rec.Headers {
			if h.Key == "tenant" && (string(h.Value) == "acme" || string(h.Value) == "globex") {
				return string(h.Value), nil
			}
		}
		return "", errors.New("unknown tenant")
	})
	r := newRig(t, memory.New(), nil, nil, []consumer.Option{tenants})
	r.publish("", "no id", "tenant", "acme")
	r.publish("x", "no tenant")
	r.publish("a", "first body", "tenant", "acme")
	r.publish("a", "same id, other tenant", "tenant", "globex")
	r.publish("a", "same id, other body", "tenant", "acme")
	r.consume(5)
	if got := r.outcomes(); got[consumer.Rejected] != 3 || got[consumer.Processed] != 2 {
		t.Fatalf("outcomes %v, want 3 rejected (no id, no tenant, reused id) and 2 processed", got)
	}
	if dead := r.deadLetters(); len(dead) != 3 || !errors.Is(dead[0], consumer.ErrNoID) || !errors.Is(dead[2], consumer.ErrReusedID) {
		t.Fatalf("dead letters %v", dead)
	}
	r.settled()
}

// A record whose context ends while it waits to be tried again is not
// committed: the Broker's Settle sets its partition back to it, the records
// after it in the poll are skipped (ErrRewound), not committed, and the
// next poll brings it and them again.
func TestUnsettledRecordRewinds(t *testing.T) {
	var mu sync.Mutex
	fail := true
	r := newRig(t, memory.New(), func(_ context.Context, rec *kgo.Record) error {
		mu.Lock()
		defer mu.Unlock()
		if string(rec.Value) == "second" && fail {
			return errors.New("ledger unreachable")
		}
		return nil
	}, nil, []consumer.Option{consumer.WithBackoff(time.Hour, time.Hour)})
	for _, body := range []string{"first", "second", "third"} {
		r.publish(body, body)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var rs []*kgo.Record
	for len(rs) < 3 {
		more, err := idemkafka.NextBatch(ctx, r.cl, 3, 0)
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, more...)
	}
	var got []string
	for i, rec := range rs {
		hctx := context.Background()
		if i == 1 {
			var stop context.CancelFunc
			hctx, stop = context.WithTimeout(hctx, 200*time.Millisecond) // ends within its hour of backoff
			defer stop()
		}
		res := r.c.Handle(hctx, rec)
		got = append(got, fmt.Sprintf("%s:%s", rec.Value, res.Outcome))
		if i == 2 && !errors.Is(res.Err, idemkafka.ErrRewound) {
			t.Fatalf("the record after the unsettled one: %+v, want it skipped (ErrRewound)", res)
		}
	}
	r.cl.AllowRebalance()
	if lag := groupLag(t, r.brokers, r.group, r.topic); lag != 2 {
		t.Fatalf("%d records uncommitted after %v, want 2: the unsettled one and the one after it", lag, got)
	}
	mu.Lock()
	fail = false
	mu.Unlock()
	again, err := idemkafka.NextBatch(ctx, r.cl, 10, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(again) != 2 || string(again[0].Value) != "second" || string(again[1].Value) != "third" {
		t.Fatalf("the next poll brought %d records (%v), want second and third again", len(again), again)
	}
	for _, res := range r.c.HandleBatch(ctx, again) {
		if res.Outcome != consumer.Processed {
			t.Fatalf("a record fetched again: %+v, want processed", res)
		}
	}
	r.cl.AllowRebalance()
	if r.runsOf("third") != 1 || r.runsOf("first") != 1 {
		t.Fatalf("runs %v, want first and third once", r.runs)
	}
	r.settled()
}

// TestNewChecks: idemkafka.New refuses a client that would commit records
// it did not process, or whose topics' retention it cannot read; consumer.New
// refuses a Broker whose topics' retention outlives the ids' records; both
// accept the rest.
func TestNewChecks(t *testing.T) {
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, brokers, "ok", 1, nil)
	forever := kafkatest.Topic(t, brokers, "forever", 1, map[string]*string{"retention.ms": new("-1")})
	compacted := kafkatest.Topic(t, brokers, "compacted", 1, map[string]*string{"cleanup.policy": new("compact")})
	long := kafkatest.Topic(t, brokers, "long", 1, kafkatest.Retention(6*24*time.Hour, 2*24*time.Hour))
	h := func(context.Context, *kgo.Record) error { return nil }
	group := kafkatest.Name("g")
	for _, tc := range []struct {
		name string
		opts []kgo.Opt
		want string
	}{
		{"no group", []kgo.Opt{kgo.ConsumeTopics(topic)}, "kgo.ConsumerGroup"},
		{"autocommit", []kgo.Opt{kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic), kgo.BlockRebalanceOnPoll()}, "kgo.DisableAutoCommit"},
		{"rebalance mid-poll", []kgo.Opt{kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic), kgo.DisableAutoCommit()}, "kgo.BlockRebalanceOnPoll"},
		{"regex", []kgo.Opt{kgo.ConsumerGroup(group), kgo.ConsumeTopics("ok-.*"), kgo.ConsumeRegex(), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll()}, "kgo.ConsumeRegex"},
	} {
		cl := kafkatest.Client(t, brokers, tc.opts...)
		_, err := idemkafka.New(t.Context(), cl)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New: %v, want an error naming %s", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct {
		topic     string
		unbounded bool
		bound     time.Duration
	}{
		{forever, true, 0},
		{compacted, true, 0},
		{long, false, 8 * 24 * time.Hour},
	} {
		cl := kafkatest.GroupClient(t, brokers, group, []string{tc.topic})
		_, err := newConsumer(t, memory.New(), group, cl, h, nil, nil)
		var herr *consumer.HorizonError
		if !errors.As(err, &herr) || herr.Horizon.Unbounded != tc.unbounded || herr.Horizon.Bound != tc.bound ||
			!strings.Contains(err.Error(), "retention.ms") || !strings.Contains(err.Error(), tc.topic) {
			t.Errorf("New on topic %s: %v, want a HorizonError (unbounded %v, bound %s) naming the topic's retention.ms", tc.topic, err, tc.unbounded, tc.bound)
		}
		if _, err := newConsumer(t, memory.New(), group, cl, h, []engine.Option{engine.WithLogger(nil)}, []consumer.Option{consumer.WithHorizonWarning()}); err != nil {
			t.Errorf("New on topic %s with WithHorizonWarning: %v", tc.topic, err)
		}
	}
	cl := kafkatest.GroupClient(t, brokers, group, []string{topic})
	if _, err := newConsumer(t, memory.New(), group, cl, h, nil, nil); err != nil {
		t.Errorf("New on a topic that keeps records two days: %v", err)
	}
}
