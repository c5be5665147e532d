package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// stores are the stores every case runs on, with the consumer options of
// their mode.
func stores(t *testing.T) map[string]func(t *testing.T) (store.Store, []consumer.Option) {
	return map[string]func(t *testing.T) (store.Store, []consumer.Option){
		"memory": func(t *testing.T) (store.Store, []consumer.Option) { return memory.New(), nil },
		"postgres": func(t *testing.T) (store.Store, []consumer.Option) {
			return pgStore(t), nil
		},
		"postgres-atomic": func(t *testing.T) (store.Store, []consumer.Option) {
			return pgStore(t), []consumer.Option{consumer.WithAtomic()}
		},
	}
}

func pgStore(t *testing.T) *postgres.Store {
	st, _ := pgStoreAndPool(t)
	return st
}

// pgStoreAndPool is a store on a fresh schema, and its pool, configured
// by configure.
func pgStoreAndPool(t *testing.T, configure ...func(*pgxpool.Config)) (*postgres.Store, *pgxpool.Pool) {
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

// msg is a message of the test broker: a delivery, the handler that
// processes it, and, if set, why it cannot be read.
type msg struct {
	d       consumer.Delivery
	h       handler
	refused error
}

type handler = func(ctx context.Context) error

// batchHandler processes message i of a batch.
type batchHandler = func(ctx context.Context, i int) error

// testBroker is the Broker of msgs: it reads a msg's delivery as it is, and
// settles nothing (what a broker does with a Result is the broker suite's,
// tests/brokertest).
type testBroker struct {
	system   string
	horizons []consumer.Horizon
}

func (b testBroker) System() string                                       { return b.system }
func (testBroker) ID(m msg) (string, error)                               { return m.d.ID, nil }
func (testBroker) Settle(context.Context, []msg, []consumer.Result) error { return nil }
func (b testBroker) Horizons(time.Duration) []consumer.Horizon            { return b.horizons }

func (testBroker) Read(m msg) (consumer.Delivery, error) { return m.d, m.refused }

// testConsumer is a consumer of the test broker's messages.
type testConsumer struct{ *consumer.Consumer[msg] }

// handle handles d with h.
func (c *testConsumer) handle(ctx context.Context, d consumer.Delivery, h handler) consumer.Result {
	return c.Handle(ctx, msg{d: d, h: h})
}

// handleBatch handles ds together, h(ctx, i) processing ds[i].
func (c *testConsumer) handleBatch(ctx context.Context, ds []consumer.Delivery, h batchHandler) []consumer.Result {
	ms := make([]msg, len(ds))
	for i, d := range ds {
		ms[i] = msg{d: d, h: func(ctx context.Context) error { return h(ctx, i) }}
	}
	return c.HandleBatch(ctx, ms)
}

// run is the test consumers' handler: each message's own.
func run(ctx context.Context, m msg) error { return m.h(ctx) }

// newConsumerOn is a consumer named charges of b's messages with opts, on
// an engine on st with the retention a consumer's engine is given, then
// eopts. Its dead letters are discarded, unless opts give a hook.
func newConsumerOn(t *testing.T, b testBroker, st store.Store, eopts []engine.Option, opts ...consumer.Option) *testConsumer {
	t.Helper()
	eng, err := engine.New(st, append([]engine.Option{engine.WithRetention(consumer.RecommendedRetention)}, eopts...)...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(eng, "charges", b, run, append([]consumer.Option{consumer.WithDiscardDeadLetters()}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return &testConsumer{c}
}

// newConsumer is newConsumerOn the test broker.
func newConsumer(t *testing.T, st store.Store, eopts []engine.Option, opts ...consumer.Option) *testConsumer {
	t.Helper()
	return newConsumerOn(t, testBroker{system: "test"}, st, eopts, opts...)
}

// each runs f on every store, with a consumer whose engine has eopts and a
// logger whose records f may check.
func each(t *testing.T, f func(t *testing.T, c *testConsumer, logs *logtest.Buffer), eopts ...engine.Option) {
	eachStore(t, false, func(t *testing.T, c *testConsumer, logs *logtest.Buffer, _ *busyStore) { f(t, c, logs) }, eopts...)
}

// eachStore is each, on a busyStore if busy is set.
func eachStore(t *testing.T, busy bool, f func(t *testing.T, c *testConsumer, logs *logtest.Buffer, st *busyStore), eopts ...engine.Option) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			st, modeOpts := open(t)
			var bst *busyStore
			if busy {
				bst = newBusyStore(st)
				st = bst
			}
			logger, logs := logtest.New()
			c := newConsumer(t, st, append([]engine.Option{engine.WithLogger(logger)}, eopts...),
				append([]consumer.Option{consumer.WithBackoff(10*time.Millisecond, 80*time.Millisecond)}, modeOpts...)...)
			f(t, c, logs, bst)
			for _, raw := range []string{"msg-secret-id", "tenant-secret", "body-secret"} {
				if strings.Contains(logs.String(), raw) {
					t.Errorf("the logs hold %q:\n%s", raw, logs)
				}
			}
		})
	}
}

// busyStore wraps a store so that a test of a message's last delivery
// knows when it finds its message in progress elsewhere: Busy closes the
// first time a reservation (Reserve, or Begin in atomic mode) finds its
// key in progress.
type busyStore struct {
	store.Store
	once sync.Once
	busy chan struct{}
}

func newBusyStore(st store.Store) *busyStore { return &busyStore{Store: st, busy: make(chan struct{})} }

// Busy is closed once a reservation has found its key in progress.
func (s *busyStore) Busy() <-chan struct{} { return s.busy }

func (s *busyStore) note(res store.Entry, err error) {
	if err == nil && res.State == store.Held {
		s.once.Do(func() { close(s.busy) })
	}
}

func (s *busyStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := s.Store.Reserve(ctx, r)
	s.note(res, err)
	return res, err
}

// Begin is the wrapped store's (store.Atomic), for a consumer in atomic
// mode, which only a store that implements it is given.
func (s *busyStore) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	res, tx, err := s.Store.(store.Atomic).Begin(ctx, r)
	s.note(res, err)
	return res, tx, err
}

// Find is the wrapped store's (store.Finder: memory and postgres are).
func (s *busyStore) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	return s.Store.(store.Finder).Find(ctx, key)
}

func delivery(id string, attempt int) consumer.Delivery {
	return consumer.Delivery{ID: id, Tenant: "tenant-secret", Body: []byte("body-secret " + id), Attempt: attempt, Redelivered: attempt > 1}
}

// counter is a handler that counts its runs and returns err.
type counter struct {
	mu   sync.Mutex
	runs int
	err  error
}

func (h *counter) handle(context.Context) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.runs++
	return h.err
}

// TestNew: a consumer needs an engine, a broker and a handler, and nothing
// of an engine's tenants: the message's is read with WithMessageTenant.
func TestNew(t *testing.T) {
	b := testBroker{system: "test"}
	if _, err := consumer.New(nil, "charges", b, run); err == nil || !strings.Contains(err.Error(), "engine.New(") {
		t.Fatalf("New(nil) = %v, want an error that names engine.New", err)
	}
	eng, err := engine.New(memory.New(), engine.WithLogger(nil)) // neither WithTenant nor WithSingleTenant
	if err != nil {
		t.Fatal(err)
	}
	if _, err := consumer.New[msg](eng, "charges", nil, run); err == nil || !strings.Contains(err.Error(), "broker") {
		t.Fatalf("New without a broker = %v, want an error that names the broker", err)
	}
	if _, err := consumer.New(eng, "charges", b, run); err == nil || !strings.Contains(err.Error(), "consumer.WithDiscardDeadLetters") {
		t.Fatalf("New without a dead-letter hook = %v, want an error that names consumer.WithDiscardDeadLetters", err)
	}
	other := func(string) (string, error) { return "", nil } // a function of another broker's messages
	for name, opt := range map[string]consumer.Option{
		"WithMessageID": consumer.WithMessageID(other), "WithMessageTenant": consumer.WithMessageTenant(other),
		"WithDeadLetter": consumer.WithDeadLetter(func(context.Context, string, error) error { return nil }),
	} {
		if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), opt); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("New with %s of another message type = %v, want an error that names it", name, err)
		}
	}
	tenant := consumer.WithMessageTenant(func(m msg) (string, error) { return string(m.d.Body), nil })
	c, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), tenant)
	if err != nil {
		t.Fatalf("New on an engine without a tenant: %v", err)
	}
	h := &counter{}
	d := delivery("msg-secret-id", 1)
	if res := c.Handle(t.Context(), msg{d: d, h: h.handle}); res.Outcome != consumer.Processed {
		t.Fatalf("%+v, want processed", res)
	}
	d.Body = []byte("another tenant")
	if res := c.Handle(t.Context(), msg{d: d, h: h.handle}); res.Outcome != consumer.Processed || h.runs != 2 {
		t.Fatalf("the same id of another tenant: %+v after %d runs, want processed, twice", res, h.runs)
	}
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithAtomic(), consumer.WithDiscardDeadLetters()); err == nil || !strings.Contains(err.Error(), "store.Atomic") {
		t.Fatalf("New(WithAtomic) on memory = %v, want an error that names store.Atomic", err)
	}
}

// TestMessageID: WithMessageID replaces the broker's id, and an error of
// either refuses the message without running it.
func TestMessageID(t *testing.T) {
	byBody := consumer.WithMessageID(func(m msg) (string, error) {
		if len(m.d.Body) == 0 {
			return "", errors.New("no body-secret")
		}
		return string(m.d.Body), nil
	})
	c := newConsumer(t, memory.New(), []engine.Option{engine.WithLogger(nil)}, byBody)
	h := &counter{}
	for i, id := range []string{"one", "two", "one"} {
		c.handle(t.Context(), consumer.Delivery{ID: id + "-the-broker's", Body: []byte("body " + fmt.Sprint(i%2))}, h.handle)
	}
	if h.runs != 2 {
		t.Fatalf("%d runs of three messages with two bodies, want 2: the ids are the bodies", h.runs)
	}
	if res := c.handle(t.Context(), consumer.Delivery{ID: "three"}, h.handle); res.Outcome != consumer.Rejected || h.runs != 2 {
		t.Fatalf("a message whose id cannot be read: %v after %d runs, want rejected, unrun", res, h.runs)
	}
}

// TestTenantIDs: a broker whose own ids are deduplicated across tenants
// (CheckTenantIDs) refuses a tenant function with them.
func TestTenantIDs(t *testing.T) {
	eng, err := engine.New(memory.New(), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	b := sharedIDs{testBroker{system: "test"}}
	tenant := consumer.WithMessageTenant(func(msg) (string, error) { return "", nil })
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), tenant); !errors.Is(err, errSharedIDs) {
		t.Fatalf("New with a tenant and the broker's ids = %v, want the broker's refusal", err)
	}
	own := consumer.WithMessageID(func(m msg) (string, error) { return m.d.ID, nil })
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), tenant, own); err != nil {
		t.Fatalf("New with a tenant and ids of the consumer's own: %v", err)
	}
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters()); err != nil {
		t.Fatalf("New without a tenant: %v", err)
	}
}

// sharedIDs is a broker that deduplicates its own ids across tenants.
type sharedIDs struct{ testBroker }

var errSharedIDs = errors.New("the broker's ids are shared across tenants")

func (sharedIDs) CheckTenantIDs(id any) error {
	if id == nil {
		return errSharedIDs
	}
	return nil
}

func TestProcessedOnce(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		h := &counter{}
		for i, want := range []consumer.Outcome{consumer.Processed, consumer.Duplicate, consumer.Duplicate} {
			res := c.handle(t.Context(), delivery("msg-secret-id", i+1), h.handle)
			if res.Outcome != want || res.Action != consumer.Ack || res.DeadLetter || res.Err != nil {
				t.Fatalf("delivery %d: %+v, want %s and ack", i+1, res, want)
			}
		}
		if h.runs != 1 {
			t.Fatalf("handler ran %d times, want 1", h.runs)
		}
		other := delivery("msg-secret-id", 1)
		other.Tenant = "another tenant"
		if res := c.handle(t.Context(), other, h.handle); res.Outcome != consumer.Processed {
			t.Fatalf("same id of another tenant: %v, want processed", res)
		}
	})
}

func TestFinalFailures(t *testing.T) {
	for _, err := range []error{
		consumer.Final(errors.New("poison")),
		status.Error(codes.FailedPrecondition, "card declined"),
		consumer.Final(status.Error(codes.InvalidArgument, "amount must be positive")),
		status.Error(codes.Unknown, "the charge's outcome is unknown"),
		fmt.Errorf("wrapped: %w", status.Error(codes.AlreadyExists, "duplicate reference")),
	} {
		t.Run(err.Error(), func(t *testing.T) {
			each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
				h := &counter{err: err}
				res := c.handle(t.Context(), delivery("msg-secret-id", 1), h.handle)
				if res.Outcome != consumer.Failed || res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, err) {
					t.Fatalf("first: %+v, want failed, ack, dead letter", res)
				}
				res = c.handle(t.Context(), delivery("msg-secret-id", 2), h.handle)
				if res.Outcome != consumer.Duplicate || res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrFailedBefore) {
					t.Fatalf("redelivery: %+v, want a duplicate, dead-lettered again", res)
				}
				if h.runs != 1 {
					t.Fatalf("handler ran %d times, want 1", h.runs)
				}
			})
		})
	}
}

func TestTransientFailures(t *testing.T) {
	for _, err := range []error{
		errors.New("connection refused"),
		status.Error(codes.Unavailable, "the ledger is unavailable"),
		context.DeadlineExceeded,
	} {
		t.Run(err.Error(), func(t *testing.T) {
			each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
				h := &counter{err: err}
				for attempt := 1; attempt <= 3; attempt++ {
					res := c.handle(t.Context(), delivery("msg-secret-id", attempt), h.handle)
					if res.Outcome != consumer.Retry || res.Action != consumer.Nak || res.DeadLetter || !errors.Is(res.Err, err) {
						t.Fatalf("attempt %d: %+v, want retry with a nak", attempt, res)
					}
					if first := 10 * time.Millisecond << (attempt - 1); res.Delay > first || res.Delay < first*3/4 {
						t.Fatalf("attempt %d: delay %s, want %s less at most a quarter", attempt, res.Delay, first)
					}
				}
				h.err = nil
				if res := c.handle(t.Context(), delivery("msg-secret-id", 4), h.handle); res.Outcome != consumer.Processed {
					t.Fatalf("after the failures: %v, want processed", res)
				}
				if h.runs != 4 {
					t.Fatalf("handler ran %d times, want 4", h.runs)
				}
				if res := c.handle(t.Context(), delivery("msg-secret-id", 99), h.handle); res.Outcome != consumer.Duplicate {
					t.Fatalf("redelivery: %v, want duplicate", res)
				}
			})
		})
	}
}

func TestBackoffBounded(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		res := c.handle(t.Context(), delivery("msg-secret-id", 1<<20), func(context.Context) error { return errors.New("down") })
		if res.Delay > 80*time.Millisecond || res.Delay < 60*time.Millisecond {
			t.Fatalf("delay %s on a late attempt, want at most the maximum, 80ms, less a quarter", res.Delay)
		}
	})
}

func TestRefused(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, logs *logtest.Buffer) {
		h := &counter{}
		for _, tc := range []struct {
			d    consumer.Delivery
			want error
		}{
			{delivery("", 1), consumer.ErrNoID},
			{delivery(strings.Repeat("x", 256), 1), consumer.ErrInvalidID},
		} {
			res := c.handle(t.Context(), tc.d, h.handle)
			if res.Outcome != consumer.Rejected || res.Action != consumer.Reject || !res.DeadLetter || !errors.Is(res.Err, tc.want) {
				t.Fatalf("%+v, want refused with %v", res, tc.want)
			}
		}
		c.handle(t.Context(), delivery("msg-secret-id", 1), h.handle)
		reused := delivery("msg-secret-id", 1)
		reused.Body = []byte("another body")
		if res := c.handle(t.Context(), reused, h.handle); res.Outcome != consumer.Rejected || !errors.Is(res.Err, consumer.ErrReusedID) {
			t.Fatalf("reused id: %+v, want refused", res)
		}
		// A broker's error may quote the message: its words are not logged
		// (each checks the logs for "tenant-secret").
		unread := msg{refused: errors.New("unknown tenant tenant-secret"), h: h.handle}
		if res := c.Handle(t.Context(), unread); res.Outcome != consumer.Rejected || res.Action != consumer.Reject || !res.DeadLetter {
			t.Fatalf("a message the broker cannot read: %+v, want it refused", res)
		}
		if h.runs != 1 {
			t.Fatalf("handler ran %d times, want 1", h.runs)
		}
		if n := strings.Count(logs.String(), "message refused"); n != 4 {
			t.Fatalf("%d refusals logged, want 4:\n%s", n, logs)
		}
	})
}

// TestBusy: a redelivery while the first run is in its handler is delayed,
// and dropped once that run is recorded.
func TestBusy(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		started, release := make(chan struct{}), make(chan struct{})
		first := make(chan consumer.Result, 1)
		go func() {
			first <- c.handle(t.Context(), delivery("msg-secret-id", 1), func(context.Context) error {
				close(started)
				<-release
				return nil
			})
		}()
		<-started
		h := &counter{}
		res := c.handle(t.Context(), delivery("msg-secret-id", 2), h.handle)
		// Delayed until the first run's lease ends, which does not spend the
		// broker's deliveries.
		if res.Outcome != consumer.Busy || res.Action != consumer.Nak || res.Delay < engine.DefaultLease-10*time.Second || res.Delay > engine.DefaultLease {
			t.Fatalf("while in progress: %+v, want busy with a nak until the lease of %s ends", res, engine.DefaultLease)
		}
		close(release)
		if res := <-first; res.Outcome != consumer.Processed {
			t.Fatalf("first: %v", res)
		}
		if res := c.handle(t.Context(), delivery("msg-secret-id", 3), h.handle); res.Outcome != consumer.Duplicate {
			t.Fatalf("after: %v, want duplicate", res)
		}
		if h.runs != 0 {
			t.Fatalf("the redeliveries ran the handler %d times", h.runs)
		}
	})
}

// TestPanicReleases: a handler that panics fails for now: the consumer
// goes on, its id is released for the redelivery, and the log names the
// panic value's type, never its words.
func TestPanicReleases(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, logs *logtest.Buffer) {
		res := c.handle(t.Context(), delivery("msg-secret-id", 1), func(context.Context) error { panic("boom body-secret") })
		if res.Outcome != consumer.Retry || res.Action != consumer.Nak || !errors.Is(res.Err, consumer.ErrPanicked) {
			t.Fatalf("a panic: %+v, want it failed for now, redelivered, with ErrPanicked", res)
		}
		if !strings.Contains(logs.String(), "handler panicked") || !strings.Contains(logs.String(), "a panic of type string") {
			t.Fatalf("the panic was not logged with its type:\n%s", logs)
		}
		h := &counter{}
		if res := c.handle(t.Context(), delivery("msg-secret-id", 2), h.handle); res.Outcome != consumer.Processed || h.runs != 1 {
			t.Fatalf("after a panic: %v, %d runs; want processed once", res, h.runs)
		}
	})
}

func TestStoreFull(t *testing.T) {
	c := newConsumer(t, memory.New(memory.WithMaxRecords(1)), []engine.Option{engine.WithLogger(nil)})
	h := &counter{}
	c.handle(t.Context(), delivery("one", 1), h.handle)
	res := c.handle(t.Context(), delivery("two", 1), h.handle)
	if res.Outcome != consumer.StoreFailed || res.Action != consumer.Nak || res.Delay <= 0 || h.runs != 1 {
		t.Fatalf("%+v after %d runs, want store full, nak with a delay, the handler not run", res, h.runs)
	}
}

// TestStoreUnavailable: with its database gone, a message is redelivered
// later, never processed unprotected.
func TestStoreUnavailable(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	for _, atomic := range []bool{false, true} {
		var opts []consumer.Option
		if atomic {
			opts = append(opts, consumer.WithAtomic())
		}
		c := newConsumer(t, st, []engine.Option{engine.WithLogger(nil)}, opts...)
		pool.Close()
		h := &counter{}
		res := c.handle(t.Context(), delivery("one", 1), h.handle)
		if res.Outcome != consumer.StoreFailed || res.Action != consumer.Nak || h.runs != 0 {
			t.Fatalf("atomic %v: %+v after %d runs, want store unavailable, a nak, the handler not run", atomic, res, h.runs)
		}
	}
}

// TestAtomicWrites: the handler's writes commit with a processed record, and
// are undone for a recorded failure.
func TestAtomicWrites(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, st, []engine.Option{engine.WithLogger(nil)}, consumer.WithAtomic())
	write := func(id string, fail error) handler {
		return func(ctx context.Context) error {
			tx, _ := postgres.TxFromContext(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, id); err != nil {
				return err
			}
			return fail
		}
	}
	c.handle(t.Context(), delivery("ok", 1), write("ok", nil))
	c.handle(t.Context(), delivery("declined", 1), write("declined", status.Error(codes.FailedPrecondition, "declined")))
	c.handle(t.Context(), delivery("down", 1), write("down", errors.New("down")))
	var got []string
	rows, _ := pool.Query(t.Context(), `SELECT id FROM effects`)
	for rows.Next() {
		var id string
		rows.Scan(&id)
		got = append(got, id)
	}
	if fmt.Sprint(got) != "[ok]" {
		t.Fatalf("effects %v, want only the processed message's", got)
	}
	if res := c.handle(t.Context(), delivery("declined", 2), write("declined", nil)); res.Outcome != consumer.Duplicate || !res.DeadLetter {
		t.Fatalf("redelivered failure: %+v", res)
	}
	if res := c.handle(t.Context(), delivery("down", 2), write("down", nil)); res.Outcome != consumer.Processed {
		t.Fatalf("redelivered transient failure: %+v", res)
	}
}

// TestHorizon: New refuses a consumer whose records would expire while its
// broker may deliver a message again, unless WithHorizonWarning, which logs
// it at Error level.
func TestHorizon(t *testing.T) {
	logger, logs := logtest.New()
	eopts := []engine.Option{engine.WithRetention(48 * time.Hour), engine.WithLogger(logger)}
	eng, err := engine.New(memory.New(), eopts...)
	if err != nil {
		t.Fatal(err)
	}
	newOn := func(horizons ...consumer.Horizon) error {
		_, err := consumer.New(eng, "charges", testBroker{system: "test", horizons: horizons}, run, consumer.WithDiscardDeadLetters())
		return err
	}
	if err := newOn(consumer.Horizon{Bound: 48 * time.Hour}); err != nil {
		t.Fatalf("a horizon equal to the retention: %v", err)
	}
	var herr *consumer.HorizonError
	for _, h := range []consumer.Horizon{{Bound: 49 * time.Hour, Source: "stream S: max age"}, {Unbounded: true, Source: "queue q has no x-message-ttl"}} {
		err := newOn(consumer.Horizon{Bound: time.Hour}, h)
		if !errors.As(err, &herr) || !strings.Contains(err.Error(), h.Source) || !strings.Contains(err.Error(), "48h") {
			t.Fatalf("%+v: %v, want a HorizonError naming the retention and %q", h, err, h.Source)
		}
	}
	b := testBroker{system: "test", horizons: []consumer.Horizon{{Unbounded: true, Source: "queue q has no x-message-ttl"}}}
	if _, err := consumer.New(eng, "charges", b, run, consumer.WithDiscardDeadLetters(), consumer.WithHorizonWarning()); err != nil {
		t.Fatalf("with WithHorizonWarning: %v", err)
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "x-message-ttl") {
		t.Fatalf("the warning was not logged at Error level:\n%s", logs)
	}
}

// TestLastDelivery: on the broker's last delivery, a message that would be
// delivered again is dead-lettered and acknowledged instead, and logged as
// dead-lettered only once the hook has it.
func TestLastDelivery(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			st, modeOpts := open(t)
			logger, logs := logtest.New()
			var causes []string
			hook := consumer.WithDeadLetter(func(_ context.Context, _ msg, err error) error {
				if strings.Contains(logs.String(), "dead-lettered") {
					t.Errorf("logged as dead-lettered before the hook had it:\n%s", logs)
				}
				causes = append(causes, consumer.Cause(err))
				return nil
			})
			c := newConsumer(t, st, []engine.Option{engine.WithLogger(logger)}, append(modeOpts, hook)...)
			last := delivery("msg-secret-id", 5)
			last.Last = true
			res := c.handle(t.Context(), last, func(context.Context) error { return errors.New("down, tenant-secret") })
			if res.Outcome != consumer.Retry || res.Action != consumer.Ack || !res.DeadLetter || !errors.Is(res.Err, consumer.ErrLastDelivery) {
				t.Fatalf("last delivery of a transient failure: %+v, want it dead-lettered and acknowledged", res)
			}
			if fmt.Sprint(causes) != "[idemkey/consumer: the message's last delivery did not process it: "+
				"an error of type *errors.errorString (its words are left out: they may quote the message)]" {
				t.Fatalf("dead letters with causes %q", causes)
			}
			if n := strings.Count(logs.String(), "failed for now on its last delivery is dead-lettered"); n != 1 {
				t.Fatalf("%d last deliveries logged as dead-lettered, want 1:\n%s", n, logs)
			}
			if strings.Contains(logs.String(), "secret") {
				t.Fatalf("the logs hold a raw id, tenant or body:\n%s", logs)
			}
		})
	}
}

// untilBusy returns once the last delivery whose result comes on last has
// found its message in progress elsewhere (st's Busy); it fails if the
// delivery returns first. What the delivery then returns tells whether it
// waited for the run that holds its message.
func untilBusy(t *testing.T, st *busyStore, last <-chan consumer.Result) {
	t.Helper()
	select {
	case <-st.Busy():
	case res := <-last:
		t.Fatalf("the last delivery returned before it found its message in progress: %+v", res)
	case <-time.After(20 * time.Second):
		t.Fatal("the last delivery did not find its message in progress within 20s")
	}
}

// busyLast runs a first delivery of a message whose handler blocks, then
// the message's last delivery, which finds it in progress; once the last
// delivery waits for the first run, the first run's handler returns first.
// It returns both results.
func busyLast(t *testing.T, c *testConsumer, st *busyStore, first error, last handler) (consumer.Result, consumer.Result) {
	t.Helper()
	started, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	firstRes, done := make(chan consumer.Result, 1), make(chan struct{})
	t.Cleanup(func() { once.Do(func() { close(release) }); <-done }) // before the store goes
	go func() {
		defer close(done)
		firstRes <- c.handle(t.Context(), delivery("msg-secret-id", 1), func(context.Context) error {
			close(started)
			<-release
			return first
		})
	}()
	<-started
	d := delivery("msg-secret-id", 3)
	d.Last = true
	lastRes := make(chan consumer.Result, 1)
	go func() { lastRes <- c.handle(t.Context(), d, last) }()
	untilBusy(t, st, lastRes)
	once.Do(func() { close(release) })
	var r1, r2 consumer.Result
	for range 2 {
		select {
		case r1 = <-firstRes:
		case r2 = <-lastRes:
		case <-time.After(30 * time.Second):
			t.Fatal("a delivery was not processed within 30s")
		}
	}
	return r1, r2
}

// TestLastDeliveryBusy: the last delivery of a message in progress elsewhere
// waits for that run to end, and ends the message itself if that run
// released it: the broker will not deliver it again, and a message that the
// other run negative-acknowledges would be lost.
func TestLastDeliveryBusy(t *testing.T) {
	down := errors.New("ledger down, tenant-secret")
	declined := status.Error(codes.FailedPrecondition, "declined")
	for _, tc := range []struct {
		name        string
		first, last error // the runs' errors
		outcome     consumer.Outcome
		deadLetter  error // what Result.Err wraps, if it is dead-lettered
		lastRuns    int   // runs of the last delivery's handler
	}{
		// The first run fails for now and releases the id: the last
		// delivery takes the message over.
		{"released then processed", down, nil, consumer.Processed, nil, 1},
		{"released then failed for now", down, down, consumer.Retry, consumer.ErrLastDelivery, 1},
		// The first run ends the message: the last delivery is a duplicate.
		{"processed", nil, nil, consumer.Duplicate, nil, 0},
		{"failed", declined, nil, consumer.Duplicate, consumer.ErrFailedBefore, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachStore(t, true, func(t *testing.T, c *testConsumer, _ *logtest.Buffer, st *busyStore) {
				h := &counter{err: tc.last}
				first, res := busyLast(t, c, st, tc.first, h.handle)
				if tc.first != nil && !errors.Is(first.Err, tc.first) {
					t.Fatalf("first run: %+v", first)
				}
				if res.Outcome != tc.outcome || res.Action != consumer.Ack || res.DeadLetter != (tc.deadLetter != nil) ||
					(tc.deadLetter != nil && !errors.Is(res.Err, tc.deadLetter)) {
					t.Fatalf("last delivery: %+v, want %s, acknowledged, dead letter %v", res, tc.outcome, tc.deadLetter)
				}
				if h.runs != tc.lastRuns {
					t.Fatalf("the last delivery ran the handler %d times, want %d", h.runs, tc.lastRuns)
				}
			})
		})
	}
}

// TestLastDeliveryBusyGivesUp: a last delivery that stops waiting (its
// context is done) while its message is still in progress elsewhere
// dead-letters it, rather than leave it to a run that may fail for now.
func TestLastDeliveryBusyGivesUp(t *testing.T) {
	eachStore(t, true, func(t *testing.T, c *testConsumer, _ *logtest.Buffer, st *busyStore) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		h := &counter{}
		defer hold(t, c, "msg-secret-id")()
		d := delivery("msg-secret-id", 3)
		d.Last = true
		lastRes := make(chan consumer.Result, 1)
		go func() { lastRes <- c.handle(ctx, d, h.handle) }()
		untilBusy(t, st, lastRes)
		cancel()
		res := <-lastRes
		if res.Outcome != consumer.Busy || res.Action != consumer.Ack || !res.DeadLetter ||
			!errors.Is(res.Err, consumer.ErrLastDelivery) || !errors.Is(res.Err, context.Canceled) {
			t.Fatalf("last delivery that stopped waiting: %+v, want it dead-lettered and acknowledged", res)
		}
		if h.runs != 0 {
			t.Fatalf("the last delivery ran the handler %d times", h.runs)
		}
	})
}

// TestLastDeliveryBusyLeaseEnds: the wait of a last delivery ends with the
// other run's lease: a run that outlasts it is presumed dead, and the last
// delivery runs the handler.
func TestLastDeliveryBusyLeaseEnds(t *testing.T) {
	st := newBusyStore(memory.New())
	c := newConsumer(t, st, []engine.Option{engine.WithLease(300 * time.Millisecond), engine.WithLogger(nil)})
	defer hold(t, c, "msg-secret-id")()
	d := delivery("msg-secret-id", 3)
	d.Last = true
	h := &counter{}
	if res := c.handle(t.Context(), d, h.handle); res.Outcome != consumer.Processed || res.Action != consumer.Ack || h.runs != 1 {
		t.Fatalf("last delivery after the other run's lease: %+v, %d runs; want it processed", res, h.runs)
	}
	select {
	case <-st.Busy():
	default:
		t.Fatal("the last delivery did not find the message in progress, so did not wait")
	}
}

// TestBackoffSaturates: a maximum too large to double to does not overflow.
func TestBackoffSaturates(t *testing.T) {
	c := newConsumer(t, memory.New(), []engine.Option{engine.WithLogger(nil)}, consumer.WithBackoff(time.Second, math.MaxInt64))
	for _, attempt := range []int{1, 2, 40, 1 << 20} {
		res := c.handle(t.Context(), delivery(fmt.Sprint(attempt), attempt), func(context.Context) error { return errors.New("down") })
		if res.Delay < time.Second*3/4 {
			t.Fatalf("attempt %d: delay %s", attempt, res.Delay)
		}
	}
}

// TestLastDeliveryBusyHandlerTimeout: with WithHandlerTimeout, the run
// that holds a message has the timeout plus a grace as its lease, and a
// last delivery waits it out and takes the message over, its handler with
// the whole timeout, while the first run is still held (two-phase mode: a
// run that outlasts its lease may run beside itself).
func TestLastDeliveryBusyHandlerTimeout(t *testing.T) {
	const timeout = 300 * time.Millisecond
	st := newBusyStore(memory.New())
	c := newConsumer(t, st, []engine.Option{engine.WithLogger(nil)}, consumer.WithHandlerTimeout(timeout))
	defer hold(t, c, "msg-secret-id")()
	d := delivery("msg-secret-id", 3)
	d.Last = true
	var deadline time.Duration
	res := c.handle(t.Context(), d, func(ctx context.Context) error {
		dl, _ := ctx.Deadline()
		deadline = time.Until(dl)
		return nil
	})
	if res.Outcome != consumer.Processed || res.Action != consumer.Ack {
		t.Fatalf("%+v (%v), want the last delivery to take the message over once the other run's lease ended", res, res.Err)
	}
	if deadline <= 0 || deadline > timeout {
		t.Errorf("the handler that took over had %v left, want its own handler timeout, %v at most", deadline, timeout)
	}
	select {
	case <-st.Busy():
	default:
		t.Fatal("the last delivery did not find the message in progress, so did not wait")
	}
}

// hold processes the message id on c with a handler that runs until the
// returned function is called, which then waits for it; hold returns once
// the handler runs, so the id is in progress.
func hold(t *testing.T, c *testConsumer, id string) (release func()) {
	t.Helper()
	started, stop, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		c.handle(t.Context(), delivery(id, 1), func(context.Context) error { close(started); <-stop; return nil })
	}()
	<-started
	return func() { close(stop); <-done }
}
