// Package brokertest is one suite of what a message consumer does on a real
// broker, which every broker module runs against its own broker: the same
// test names on NATS JetStream, RabbitMQ and Kafka (kfake). A broker's test
// file builds a Rig of its own and runs the suite in one line:
//
//	func TestSuite(t *testing.T) { brokertest.Run(t, brokertest.Features{DeliveryLimit: true}, newSuiteRig) }
//
// The rig gives a stream, queue or topic of its own, its broker module's
// consumer.Broker, a way to publish and a way to consume; the suite builds
// the consumer on it (the store, the options a case needs, a logger whose
// records it checks for raw ids and bodies) and checks what a user would
// see. What a broker cannot do is a Features field, and the cases that need
// it are skipped where it is false.
package brokertest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// Features says what a broker can do that some cases need.
type Features struct {
	// DeliveryLimit is true when a rig can bound a message's deliveries
	// (Config.MaxDeliveries): JetStream's max deliver, a quorum queue's
	// x-delivery-limit, Kafka's attempts.
	DeliveryLimit bool
}

// Config is what a case asks of a rig.
type Config struct {
	// MaxDeliveries bounds a message's deliveries, where the broker can
	// (Features.DeliveryLimit); 0 leaves the rig's default.
	MaxDeliveries int
}

// Rig is a stream, queue or topic of a case's own, and its broker module's
// consumer.Broker.
type Rig[M any] interface {
	// Broker is the module's Broker of the rig's messages.
	Broker() consumer.Broker[M]
	// Publish publishes a message with id (none if empty) and body, and
	// returns once the broker has it; a broker that drops a resent id for
	// a while (JetStream's duplicate window) sends it again until it takes
	// it.
	Publish(t *testing.T, id, body string)
	// Consume hands each message to handle, one at a time, until ctx ends.
	Consume(ctx context.Context, t *testing.T, handle func(M))
}

// NewRig builds a Rig for cfg.
type NewRig[M any] func(t *testing.T, cfg Config) Rig[M]

// Run runs every case on newRig's broker.
func Run[M any](t *testing.T, f Features, newRig NewRig[M]) {
	t.Run("ResendDropped", func(t *testing.T) { resendDropped(t, newRig) })
	t.Run("FinalFailureDeadLettered", func(t *testing.T) { finalFailure(t, newRig) })
	t.Run("TransientFailureRedelivered", func(t *testing.T) { transientFailure(t, newRig, errors.New("the ledger is down")) })
	t.Run("InvalidArgumentRedelivered", func(t *testing.T) {
		transientFailure(t, newRig, status.Error(codes.InvalidArgument, "amount"))
	})
	t.Run("PanicRedelivered", func(t *testing.T) { transientFailure(t, newRig, nil) })
	t.Run("RefusedWithoutID", func(t *testing.T) { refusedWithoutID(t, newRig) })
	t.Run("AtomicWritesCommitWithRecord", func(t *testing.T) { atomicWrites(t, newRig) })
	t.Run("NowhereToDeadLetter", func(t *testing.T) { nowhereToDeadLetter(t, newRig) })
	t.Run("LastDeliveryDeadLettered", func(t *testing.T) {
		needs(t, f.DeliveryLimit)
		lastDelivery(t, newRig)
	})
	t.Run("StoreDownOnLastDelivery", func(t *testing.T) {
		needs(t, f.DeliveryLimit)
		storeDown(t, newRig)
	})
}

func needs(t *testing.T, feature bool) {
	if !feature {
		t.Skip("the broker cannot bound a message's deliveries")
	}
}

// fast keeps redeliveries quick.
var fast = consumer.WithBackoff(20*time.Millisecond, 100*time.Millisecond)

// session is one case's consumer, running: its logs, the handler's runs by
// id, the Results and the dead letters.
type session struct {
	t    *testing.T
	logs *logtest.Buffer
	// publish is the rig's Publish.
	publish func(t *testing.T, id, body string)

	mu      sync.Mutex
	runs    map[string]int
	results []consumer.Result
	dead    []error
}

// start builds a consumer on st with opts, on a rig of newRig's, with h
// (counted) and a dead-letter hook that keeps what it is given, and
// consumes until t ends.
func start[M any](t *testing.T, newRig NewRig[M], st store.Store, h func(ctx context.Context, id string) error, maxDeliveries int, opts ...consumer.Option) *session {
	t.Helper()
	logger, logs := logtest.New()
	s := &session{t: t, logs: logs, runs: map[string]int{}}
	eng, err := engine.New(st, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	rig := newRig(t, Config{MaxDeliveries: maxDeliveries})
	s.publish = rig.Publish
	b := rig.Broker()
	keep := consumer.WithDeadLetter(func(_ context.Context, _ M, err error) error {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.dead = append(s.dead, err)
		return nil
	})
	c, err := consumer.New(eng, "charges", b, func(ctx context.Context, m M) error {
		id, _ := b.ID(m)
		s.mu.Lock()
		s.runs[id]++
		s.mu.Unlock()
		if h == nil {
			return nil
		}
		return h(ctx, id)
	}, append([]consumer.Option{fast, keep}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan struct{})
	go func() {
		defer close(done)
		rig.Consume(ctx, t, func(m M) {
			res := c.Handle(ctx, m)
			s.mu.Lock()
			defer s.mu.Unlock()
			s.results = append(s.results, res)
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if strings.Contains(s.logs.String(), "secret") {
			t.Errorf("the logs hold a message's id or body:\n%s", s.logs)
		}
		if t.Failed() {
			t.Logf("outcomes %v, runs %v, dead letters %v; logs:\n%s", s.outcomes(), s.runs, s.dead, s.logs)
		}
	})
	return s
}

// waitFor waits until ok, for at most a minute, or fails.
func (s *session) waitFor(what string, ok func() bool) {
	s.t.Helper()
	for deadline := time.Now().Add(time.Minute); !ok(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			s.t.Fatalf("%s: not within a minute", what)
		}
	}
}

// ended counts the Results reported that end their message (acknowledged
// or terminated) with outcome o.
func (s *session) ended(o consumer.Outcome) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, res := range s.results {
		if res.Outcome == o && res.Action != consumer.Nak {
			n++
		}
	}
	return n
}

func (s *session) outcomes() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := map[string]int{}
	for _, res := range s.results {
		m[res.String()]++
	}
	return m
}

func (s *session) runsOf(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[id]
}

func (s *session) deadLetters() []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]error(nil), s.dead...)
}

// acked counts the Results reported with the action Ack.
func (s *session) acked() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, res := range s.results {
		if res.Action == consumer.Ack {
			n++
		}
	}
	return n
}

// secret is an id or a body that must never be logged.
func secret(what string, n int) string { return fmt.Sprintf("%s-secret-%d", what, n) }

// resendDropped: a message published again (a producer's retry) is dropped
// as a duplicate, acknowledged, without running.
func resendDropped[M any](t *testing.T, newRig NewRig[M]) {
	s := start(t, newRig, memory.New(), nil, 0)
	s.publish(t, secret("id", 1), secret("body", 1))
	s.publish(t, secret("id", 2), secret("body", 2))
	s.waitFor("two processed", func() bool { return s.ended(consumer.Processed) == 2 })
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("the resend dropped", func() bool { return s.ended(consumer.Duplicate) == 1 })
	if s.runsOf(secret("id", 1)) != 1 || s.runsOf(secret("id", 2)) != 1 {
		t.Fatalf("runs %v, want each id once", s.runs)
	}
}

// finalFailure: a final failure is recorded, acknowledged and
// dead-lettered; a resend is dead-lettered again without running.
func finalFailure[M any](t *testing.T, newRig NewRig[M]) {
	declined := status.Error(codes.FailedPrecondition, "card declined")
	s := start(t, newRig, memory.New(), func(context.Context, string) error { return declined }, 0)
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("failed", func() bool { return s.ended(consumer.Failed) == 1 })
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("the resend dropped", func() bool { return s.ended(consumer.Duplicate) == 1 })
	if n := s.runsOf(secret("id", 1)); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
	dead := s.deadLetters()
	if len(dead) != 2 || !errors.Is(dead[0], declined) || !errors.Is(dead[1], consumer.ErrFailedBefore) {
		t.Fatalf("dead letters %v, want the failure, then its resend's", dead)
	}
}

// transientFailure: a message whose handler fails for now with err (a
// panic, if err is nil), once, is redelivered and then processed; nothing
// is dead-lettered. InvalidArgument fails for now, as over gRPC.
func transientFailure[M any](t *testing.T, newRig NewRig[M], err error) {
	var calls atomic.Int32
	s := start(t, newRig, memory.New(), func(_ context.Context, id string) error {
		if calls.Add(1) > 1 {
			return nil
		}
		if err == nil {
			panic("boom " + id)
		}
		return err
	}, 0)
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("processed", func() bool { return s.ended(consumer.Processed) == 1 })
	if n := s.runsOf(secret("id", 1)); n != 2 {
		t.Fatalf("the handler ran %d times, want 2: a failure for now, then success", n)
	}
	if dead := s.deadLetters(); len(dead) != 0 {
		t.Fatalf("dead letters %v, want none", dead)
	}
}

// refusedWithoutID: a message without an id is refused, dead-lettered with
// ErrNoID, never run.
func refusedWithoutID[M any](t *testing.T, newRig NewRig[M]) {
	s := start(t, newRig, memory.New(), nil, 0)
	s.publish(t, "", secret("body", 1))
	s.waitFor("rejected", func() bool { return s.ended(consumer.Rejected) == 1 })
	if dead := s.deadLetters(); len(dead) != 1 || !errors.Is(dead[0], consumer.ErrNoID) {
		t.Fatalf("dead letters %v, want ErrNoID", dead)
	}
	if len(s.runs) != 0 {
		t.Fatalf("runs %v, want none", s.runs)
	}
}

// atomicWrites: in atomic mode the handler's writes commit with a processed
// message's record, and are undone for a final failure.
func atomicWrites[M any](t *testing.T, newRig NewRig[M]) {
	st, pool := pgStore(t)
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	s := start(t, newRig, st, func(ctx context.Context, id string) error {
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			return errors.New("not in atomic mode")
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, id); err != nil {
			return err
		}
		if strings.HasPrefix(id, "declined") {
			return status.Error(codes.FailedPrecondition, "card declined")
		}
		return nil
	}, 0, consumer.WithAtomic())
	s.publish(t, "ok-secret", secret("body", 1))
	s.publish(t, "declined-secret", secret("body", 2))
	s.waitFor("both ended", func() bool { return s.ended(consumer.Processed)+s.ended(consumer.Failed) == 2 })
	var got []string
	rows, err := pool.Query(t.Context(), `SELECT id FROM effects ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
	}
	if fmt.Sprint(got) != "[ok-secret]" {
		t.Fatalf("effects %v, want only the processed message's", got)
	}
}

// nowhereToDeadLetter: consumer.New refuses a consumer with no dead-letter
// hook, naming the way to say that such messages are discarded, and one
// whose hook takes another broker's messages.
func nowhereToDeadLetter[M any](t *testing.T, newRig NewRig[M]) {
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	b := newRig(t, Config{}).Broker()
	h := func(context.Context, M) error { return nil }
	_, err = consumer.New(eng, "charges", b, h)
	if err == nil || !strings.Contains(err.Error(), "consumer.WithDiscardDeadLetters") {
		t.Fatalf("New without a dead-letter hook: %v, want a refusal naming consumer.WithDiscardDeadLetters", err)
	}
	other := consumer.WithDeadLetter(func(context.Context, struct{}, error) error { return nil })
	if _, err := consumer.New(eng, "charges", b, h, other); err == nil || !strings.Contains(err.Error(), "WithDeadLetter") {
		t.Fatalf("New with another broker's dead-letter hook: %v, want a refusal naming WithDeadLetter", err)
	}
	if _, err := consumer.New(eng, "charges", b, h, consumer.WithDiscardDeadLetters()); err != nil {
		t.Fatalf("New with consumer.WithDiscardDeadLetters: %v", err)
	}
}

// lastDelivery: a message that fails for now on every delivery is
// dead-lettered and acknowledged on its last, with ErrLastDelivery.
func lastDelivery[M any](t *testing.T, newRig NewRig[M]) {
	s := start(t, newRig, memory.New(), func(context.Context, string) error { return errors.New("the ledger is down") }, 2)
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("dead-lettered", func() bool { return s.ended(consumer.Retry) == 1 })
	if n := s.runsOf(secret("id", 1)); n != 2 {
		t.Fatalf("the handler ran %d times, want 2: once a delivery", n)
	}
	if dead := s.deadLetters(); len(dead) != 1 || !errors.Is(dead[0], consumer.ErrLastDelivery) {
		t.Fatalf("dead letters %v, want one with ErrLastDelivery", dead)
	}
	if !strings.Contains(s.logs.String(), "is dead-lettered") {
		t.Fatalf("the dead letter was not logged:\n%s", s.logs)
	}
}

// storeDown: a store that fails is no reason to spend a message's last
// delivery: it is held, neither acknowledged nor dead-lettered, while the
// store fails (its table locked by an operator's transaction, which each
// try outwaits for 100ms), and processed once when the store answers.
func storeDown[M any](t *testing.T, newRig NewRig[M]) {
	st, pool := pgStore(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["lock_timeout"] = "100ms" })
	s := start(t, newRig, st, nil, 2)
	lock, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(t.Context(), `LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	s.publish(t, secret("id", 1), secret("body", 1))
	s.waitFor("the last delivery held", func() bool { return strings.Contains(s.logs.String(), "the delivery is held") })
	if n := s.acked(); n != 0 || len(s.deadLetters()) != 0 {
		t.Fatalf("%d acknowledged and %d dead-lettered while the store failed, want none", n, len(s.deadLetters()))
	}
	if err := lock.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	s.waitFor("processed", func() bool { return s.ended(consumer.Processed) == 1 })
	if n := s.runsOf(secret("id", 1)); n != 1 || len(s.deadLetters()) != 0 {
		t.Fatalf("the handler ran %d times with %d dead letters, want once and none", n, len(s.deadLetters()))
	}
}

// pgStore is a PostgreSQL store on a schema of t's own, and its pool.
func pgStore(t *testing.T, configure ...func(*pgxpool.Config)) (*postgres.Store, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t), configure...)
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st, pool
}
