package outbox_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

const (
	opName = "/test.v1.Payments/CreateCharge"
	tenant = "tenant-outbox-test"
	// outboxTable is the default store table's outbox (migration 004).
	outboxTable = "idempotency_keys_outbox"
	// wait bounds every wait for the relay: only a broken relay reaches
	// it, so it is generous, for a busy machine.
	wait = 60 * time.Second
)

// rig is an outbox on a PostgreSQL store of a schema of its own, with a
// table of charges for the handlers to write, and an engine with an atomic
// and a two-phase operation.
type rig struct {
	schema   string
	pool     *pgxpool.Pool
	st       *postgres.Store
	ob       *outbox.Outbox
	e        *engine.Engine
	atomic   *engine.Operation
	twoPhase *engine.Operation
	log      *logtest.Buffer
	logger   *slog.Logger
}

func newRig(t *testing.T, opts ...outbox.Option) *rig {
	t.Helper()
	r := &rig{schema: pgtest.Schema(t)}
	r.pool = pgtest.Pool(t, r.schema)
	if err := postgres.Migrate(t.Context(), r.pool); err != nil {
		t.Fatal(err)
	}
	if _, err := r.pool.Exec(t.Context(), `CREATE TABLE charges (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	var err error
	if r.st, err = postgres.New(r.pool); err != nil {
		t.Fatal(err)
	}
	if r.ob, err = outbox.New(r.st, opts...); err != nil {
		t.Fatal(err)
	}
	r.logger, r.log = logtest.New()
	r.e, err = engine.New(r.st, engine.WithLogger(r.logger),
		engine.WithTenant(func(context.Context) (string, error) { return tenant, nil }))
	if err != nil {
		t.Fatal(err)
	}
	if r.atomic, err = r.e.Operation(engine.OperationSpec{Name: opName, Atomic: true}); err != nil {
		t.Fatal(err)
	}
	if r.twoPhase, err = r.e.Operation(engine.OperationSpec{Name: opName}); err != nil {
		t.Fatal(err)
	}
	return r
}

// call is an engine.Exchange of one keyed call whose handler is run.
type call struct {
	key    string
	run    func(ctx context.Context) engine.HandlerResult
	answer engine.Answer
}

func (c *call) Key() (string, bool, error) { return c.key, true, nil }
func (c *call) FirstSent() []string        { return nil }
func (c *call) FirstRegion() []string      { return nil }
func (c *call) Attempt() engine.Attempt    { return engine.Attempt{} }
func (c *call) Fingerprint(context.Context) (store.Fingerprint, error) {
	return store.Fingerprint{1}, nil
}
func (c *call) Run(ctx context.Context) engine.HandlerResult { return c.run(ctx) }
func (c *call) StandIn(error) []byte                         { return []byte("stand-in") }
func (c *call) Pass(ctx context.Context) int                 { c.run(ctx); return 0 }
func (c *call) Answer(_ context.Context, a engine.Answer) int {
	c.answer = a
	return 0
}

// Results of a handler.
var (
	succeeded = engine.HandlerResult{Record: []byte("charged"), KeepWrites: true}
	recorded  = engine.HandlerResult{Record: []byte("not found")} // a recorded error: its writes roll back
	released  = engine.HandlerResult{Release: true}               // Unavailable: the key is freed
)

// serve serves one call of op with key through the engine.
func (r *rig) serve(op *engine.Operation, key string, run func(ctx context.Context) engine.HandlerResult) engine.Answer {
	c := &call{key: key, run: run}
	r.e.Serve(context.Background(), op, c)
	return c.answer
}

// charge is an atomic handler: it writes a charge and publishes ms in the
// call's transaction, then ends as res.
func (r *rig) charge(t *testing.T, id string, res engine.HandlerResult, ms ...outbox.Message) func(ctx context.Context) engine.HandlerResult {
	return func(ctx context.Context) engine.HandlerResult {
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			t.Error("no transaction in an atomic call")
			return released
		}
		if _, err := tx.Exec(ctx, `INSERT INTO charges (id) VALUES ($1)`, id); err != nil {
			t.Errorf("insert a charge: %v", err)
			return released
		}
		if err := r.ob.Publish(ctx, ms...); err != nil {
			t.Errorf("publish: %v", err)
			return released
		}
		return res
	}
}

// publish publishes ms outside any call, in a transaction of its own.
func (r *rig) publish(t testing.TB, ms ...outbox.Message) {
	t.Helper()
	err := pgx.BeginFunc(t.Context(), r.pool, func(tx pgx.Tx) error {
		return r.ob.Publish(postgres.ContextWithTx(t.Context(), tx), ms...)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// row is a message as the outbox table holds it.
type row struct {
	ID, PartitionKey, Destination string
	Body                          []byte
	Attempts                      int
	Sent                          bool
}

// rows returns the outbox table's rows in the order they were written.
func (r *rig) rows(t testing.TB) []row {
	t.Helper()
	rs, err := r.pool.Query(context.Background(),
		`SELECT id, partition_key, destination, body, attempts, sent_at IS NOT NULL FROM `+outboxTable+` ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rs, func(rs pgx.CollectableRow) (row, error) {
		var x row
		return x, rs.Scan(&x.ID, &x.PartitionKey, &x.Destination, &x.Body, &x.Attempts, &x.Sent)
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// count runs a count(*) query.
func (r *rig) count(t testing.TB, sql string) int {
	t.Helper()
	var n int
	if err := r.pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// recorder is the Publisher's test double: it records every batch it is
// given, and confirms each message unless fn says otherwise.
type recorder struct {
	mu        sync.Mutex
	batches   [][]outbox.Message
	confirmed []outbox.Message
	// fn, if set, answers in place of confirming all: as Publisher.Publish.
	fn func(ctx context.Context, ms []outbox.Message) []error
}

func (p *recorder) Publish(ctx context.Context, ms []outbox.Message) []error {
	p.mu.Lock()
	p.batches = append(p.batches, slices.Clone(ms))
	fn := p.fn
	p.mu.Unlock()
	var errs []error
	if fn != nil {
		errs = fn(ctx, ms)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range ms {
		if errs == nil || errs[i] == nil {
			p.confirmed = append(p.confirmed, m)
		}
	}
	return errs
}

func (p *recorder) setFn(fn func(ctx context.Context, ms []outbox.Message) []error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fn = fn
}

// sent returns the messages confirmed so far, in the order they were.
func (p *recorder) sent() []outbox.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.confirmed)
}

func (p *recorder) allBatches() [][]outbox.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.batches)
}

// refuse is a Publisher's answer that refuses every message of ms.
func refuse(ms []outbox.Message) []error {
	errs := make([]error, len(ms))
	for i := range errs {
		errs[i] = errors.New("broker unavailable")
	}
	return errs
}

// relay makes a relay of ob to pub that looks often, so that tests need
// not wait, with opts after those.
func (r *rig) relay(t *testing.T, ob *outbox.Outbox, pub outbox.Publisher, opts ...outbox.RelayOption) *outbox.Relay {
	t.Helper()
	rl, err := ob.Relay(pub, append([]outbox.RelayOption{outbox.WithPollInterval(20 * time.Millisecond),
		outbox.WithLogger(r.logger)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return rl
}

// start runs rl until the returned stop is called, or the test ends.
func start(t *testing.T, rl *outbox.Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rl.Run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Run returned %v, want context.Canceled", err)
			}
		case <-time.After(wait):
			t.Errorf("the relay did not stop within %v of its context's end", wait)
		}
	})
	t.Cleanup(stop)
	return stop
}

// waitFor waits until cond holds, failing the test if it does not within
// wait.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", wait, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
