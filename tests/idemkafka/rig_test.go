package idemkafka_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// fast keeps retries quick in tests.
var fast = consumer.WithBackoff(20*time.Millisecond, 100*time.Millisecond)

// kafkaConsumer is a consumer of the records a group's client polls.
type kafkaConsumer = consumer.Consumer[*kgo.Record]

// rig is one topic consumed by one group, whose records a consumer
// processes with a handler that counts its runs by message id, and a
// dead-letter hook that keeps each cause.
type rig struct {
	t       *testing.T
	brokers []string
	st      store.Store
	topic   string
	group   string
	prod    *kgo.Client
	cl      *kgo.Client
	c       *kafkaConsumer
	// handle is the handler c runs: h's, counted.
	handle func(context.Context, *kgo.Record) error

	mu      sync.Mutex
	runs    map[string]int
	results map[consumer.Outcome]int
	dead    []error
}

// newConsumer is a consumer named name of the records cl polls, which runs
// h, on an engine on st with the retention consumers are given, then
// eopts; opts are the consumer's, after one that discards dead letters
// (the tests that read them set a hook), and kopts the Broker's. Its error
// is idemkafka.New's or consumer.New's.
func newConsumer(t *testing.T, st store.Store, name string, cl *kgo.Client, h func(context.Context, *kgo.Record) error,
	eopts []engine.Option, opts []consumer.Option, kopts ...idemkafka.Option) (*kafkaConsumer, error) {
	t.Helper()
	eng, err := engine.New(st, append([]engine.Option{engine.WithRetention(consumer.RecommendedRetention)}, eopts...)...)
	if err != nil {
		t.Fatal(err)
	}
	b, err := idemkafka.New(t.Context(), cl, kopts...)
	if err != nil {
		return nil, err
	}
	return consumer.New(eng, name, b, h, append([]consumer.Option{consumer.WithDiscardDeadLetters()}, opts...)...)
}

// mustConsumer is newConsumer's consumer, or fails.
func mustConsumer(t *testing.T, st store.Store, name string, cl *kgo.Client, h func(context.Context, *kgo.Record) error,
	eopts []engine.Option, opts []consumer.Option, kopts ...idemkafka.Option) *kafkaConsumer {
	t.Helper()
	c, err := newConsumer(t, st, name, cl, h, eopts, opts, kopts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// newRig is a rig on st, on a topic of one partition of a cluster of its
// own, whose consumer's engine has eopts, the consumer fast retries, a
// dead-letter hook of the rig's, then opts, and the Broker kopts.
func newRig(t *testing.T, st store.Store, h func(context.Context, *kgo.Record) error, eopts []engine.Option, opts []consumer.Option, kopts ...idemkafka.Option) *rig {
	t.Helper()
	brokers := kafkatest.Brokers(t)
	r := &rig{t: t, brokers: brokers, st: st, topic: kafkatest.Topic(t, brokers, "charges", 1, nil), group: kafkatest.Name("g"),
		runs: map[string]int{}, results: map[consumer.Outcome]int{}}
	r.prod = kafkatest.Client(t, brokers)
	r.cl = kafkatest.GroupClient(t, brokers, r.group, []string{r.topic})
	r.handle = func(ctx context.Context, rec *kgo.Record) error {
		id, _ := idemkafka.MessageID(rec)
		r.mu.Lock()
		r.runs[id]++
		r.mu.Unlock()
		if h == nil {
			return nil
		}
		return h(ctx, rec)
	}
	keep := consumer.WithDeadLetter(func(_ context.Context, _ *kgo.Record, err error) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.dead = append(r.dead, err)
		return nil
	})
	r.c = mustConsumer(t, st, r.group, r.cl, r.handle, eopts, append([]consumer.Option{fast, keep}, opts...), kopts...)
	return r
}

// record is a record of the rig's topic with body, a message-id header id
// (none if empty) and extra headers.
func (r *rig) record(id, body string, headers ...string) *kgo.Record {
	rec := &kgo.Record{Topic: r.topic, Value: []byte(body)}
	if id != "" {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "message-id", Value: []byte(id)})
	}
	for i := 0; i+1 < len(headers); i += 2 {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: headers[i], Value: []byte(headers[i+1])})
	}
	return rec
}

// publish produces a record (rig.record) and waits until Kafka has it.
func (r *rig) publish(id, body string, headers ...string) {
	r.t.Helper()
	if err := r.prod.ProduceSync(r.t.Context(), r.record(id, body, headers...)).FirstErr(); err != nil {
		r.t.Fatal(err)
	}
}

// consume polls until want records were handled, one at a time, or fails.
func (r *rig) consume(want int) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(r.t.Context(), 20*time.Second)
	defer cancel()
	for ended := 0; ended < want; {
		rs, err := idemkafka.NextBatch(ctx, r.cl, 100, 0)
		if err != nil {
			r.t.Fatalf("only %d of %d records handled: %v; outcomes %v", ended, want, err, r.outcomes())
		}
		for _, rec := range rs {
			res := r.c.Handle(context.Background(), rec)
			r.count(res)
			ended++
		}
		r.cl.AllowRebalance()
	}
}

func (r *rig) count(res consumer.Result) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.results[res.Outcome]++
}

// settled fails unless the group has committed every record of the topic.
func (r *rig) settled() {
	r.t.Helper()
	settled(r.t, r.brokers, r.group, r.topic)
}

// settled fails unless group has committed every record of topic.
func settled(t *testing.T, brokers []string, group, topic string) {
	t.Helper()
	if lag := groupLag(t, brokers, group, topic); lag != 0 {
		t.Fatalf("group %s has %d records of topic %s uncommitted", group, lag, topic)
	}
}

// groupLag counts the records of topic that group has not committed.
func groupLag(t *testing.T, brokers []string, group, topic string) int64 {
	return kafkatest.Lag(t, brokers, group, topic)
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

func (r *rig) deadLetters() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.dead...)
}

// pgStore is a PostgreSQL store on a schema of t's own, and its pool.
func pgStore(t *testing.T) (store.Store, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st, pool
}
