package consumer_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/hooklog"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// batchCounter is a batch handler that records the ids it runs, in order,
// and fails the ids in fail with their error.
type batchCounter struct {
	ds   []consumer.Delivery
	fail map[string]error

	mu   sync.Mutex
	runs []string
}

func (h *batchCounter) handle(_ context.Context, i int) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.runs = append(h.runs, h.ds[i].ID)
	return h.fail[h.ds[i].ID]
}

func deliveries(attempt int, ids ...string) []consumer.Delivery {
	ds := make([]consumer.Delivery, len(ids))
	for i, id := range ids {
		ds[i] = delivery(id, attempt)
	}
	return ds
}

// outcomes are the outcomes of rs, for a failure message.
func outcomes(rs []consumer.Result) []consumer.Outcome {
	out := make([]consumer.Outcome, len(rs))
	for i, r := range rs {
		out[i] = r.Outcome
	}
	return out
}

func wantOutcomes(t *testing.T, what string, rs []consumer.Result, want ...consumer.Outcome) {
	t.Helper()
	if got := outcomes(rs); !slices.Equal(got, want) {
		t.Fatalf("%s: outcomes %v, want %v", what, got, want)
	}
}

// A batch answers as its messages would one at a time, on every store: each
// processed once, in order, and dropped as duplicates when redelivered.
func TestBatchProcessedOnce(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		ids := make([]string, 40)
		for i := range ids {
			ids[i] = fmt.Sprintf("msg-secret-id-%02d", i)
		}
		h := &batchCounter{ds: deliveries(1, ids...)}
		rs := c.handleBatch(t.Context(), h.ds, h.handle)
		for i, r := range rs {
			if r.Outcome != consumer.Processed || r.Action != consumer.Ack || r.DeadLetter || r.Err != nil {
				t.Fatalf("message %d: %+v, want processed and ack", i, r)
			}
		}
		if !slices.Equal(h.runs, ids) {
			t.Fatalf("handlers ran for %v, want each id once, in order", h.runs)
		}
		h.ds, h.runs = deliveries(2, ids...), nil
		for i, r := range c.handleBatch(t.Context(), h.ds, h.handle) {
			if r.Outcome != consumer.Duplicate || r.Action != consumer.Ack || r.DeadLetter {
				t.Fatalf("redelivery %d: %+v, want a duplicate", i, r)
			}
		}
		if len(h.runs) != 0 {
			t.Fatalf("the redeliveries ran %v", h.runs)
		}
	})
}

// An id twice in one batch is processed once: the second is a duplicate, or
// refused with another body.
func TestBatchRepeatedID(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		ds := deliveries(1, "msg-secret-id-a", "msg-secret-id-b", "msg-secret-id-a", "msg-secret-id-c", "msg-secret-id-b")
		ds[4].Body = []byte("body-secret another")
		h := &batchCounter{ds: ds}
		rs := c.handleBatch(t.Context(), ds, h.handle)
		wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Processed, consumer.Duplicate, consumer.Processed, consumer.Rejected)
		if !errors.Is(rs[4].Err, consumer.ErrReusedID) || rs[4].Action != consumer.Reject {
			t.Fatalf("the id with another body: %+v, want refused as reused", rs[4])
		}
		if want := []string{"msg-secret-id-a", "msg-secret-id-b", "msg-secret-id-c"}; !slices.Equal(h.runs, want) {
			t.Fatalf("handlers ran for %v, want %v", h.runs, want)
		}
	})
}

// A batch mixes new ids with ids processed before, one of them failed for
// good, and messages refused: each answers as it would alone.
func TestBatchMixed(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		h := &counter{}
		c.handle(t.Context(), delivery("msg-secret-id-old", 1), h.handle)
		h.err = consumer.Final(errors.New("poison"))
		c.handle(t.Context(), delivery("msg-secret-id-poison", 1), h.handle)

		ds := deliveries(2, "msg-secret-id-new", "msg-secret-id-old", "", "msg-secret-id-poison", "msg-secret-id-new2")
		b := &batchCounter{ds: ds}
		rs := c.handleBatch(t.Context(), ds, b.handle)
		wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Duplicate, consumer.Rejected, consumer.Duplicate, consumer.Processed)
		if !rs[3].DeadLetter || !errors.Is(rs[3].Err, consumer.ErrFailedBefore) || rs[1].DeadLetter {
			t.Fatalf("the duplicates: %+v and %+v; want the failed one dead-lettered again", rs[1], rs[3])
		}
		if !errors.Is(rs[2].Err, consumer.ErrNoID) {
			t.Fatalf("the message without an id: %+v", rs[2])
		}
		if want := []string{"msg-secret-id-new", "msg-secret-id-new2"}; !slices.Equal(b.runs, want) {
			t.Fatalf("handlers ran for %v, want %v", b.runs, want)
		}
	})
}

// Failures in a batch: a final one is recorded and dead-lettered, a
// transient one released and redelivered, and the others processed.
func TestBatchFailures(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		ds := deliveries(1, "msg-secret-id-1", "msg-secret-id-final", "msg-secret-id-transient", "msg-secret-id-4")
		h := &batchCounter{ds: ds, fail: map[string]error{
			"msg-secret-id-final":     status.Error(codes.FailedPrecondition, "declined"),
			"msg-secret-id-transient": errors.New("down"),
		}}
		rs := c.handleBatch(t.Context(), ds, h.handle)
		wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Failed, consumer.Retry, consumer.Processed)
		if !rs[1].DeadLetter || rs[1].Action != consumer.Ack || rs[2].Action != consumer.Nak || rs[2].Delay <= 0 {
			t.Fatalf("the failures: %+v and %+v", rs[1], rs[2])
		}
		h.ds, h.fail, h.runs = deliveries(2, "msg-secret-id-1", "msg-secret-id-final", "msg-secret-id-transient", "msg-secret-id-4"), nil, nil
		rs = c.handleBatch(t.Context(), h.ds, h.handle)
		wantOutcomes(t, "redelivery", rs, consumer.Duplicate, consumer.Duplicate, consumer.Processed, consumer.Duplicate)
		if !slices.Equal(h.runs, []string{"msg-secret-id-transient"}) {
			t.Fatalf("the redelivery ran %v, want only the transient failure", h.runs)
		}
	})
}

// A panicking handler fails for now, alone: the others of the batch are
// processed, and it is processed once when redelivered.
func TestBatchPanic(t *testing.T) {
	each(t, func(t *testing.T, c *testConsumer, _ *logtest.Buffer) {
		ds := deliveries(1, "msg-secret-id-1", "msg-secret-id-panic", "msg-secret-id-3")
		rs := c.handleBatch(t.Context(), ds, func(_ context.Context, i int) error {
			if i == 1 {
				panic("boom")
			}
			return nil
		})
		wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Retry, consumer.Processed)
		if !errors.Is(rs[1].Err, consumer.ErrPanicked) || rs[1].Action != consumer.Nak {
			t.Fatalf("the panic: %+v, want ErrPanicked, redelivered", rs[1])
		}
		h := &batchCounter{ds: deliveries(2, "msg-secret-id-1", "msg-secret-id-panic", "msg-secret-id-3")}
		rs = c.handleBatch(t.Context(), h.ds, h.handle)
		wantOutcomes(t, "redelivery", rs, consumer.Duplicate, consumer.Processed, consumer.Duplicate)
	})
}

// atomicConsumer is a consumer in atomic mode on PostgreSQL, with a table
// effects for its handlers' writes.
func atomicConsumer(t *testing.T, eopts ...engine.Option) (*testConsumer, *postgres.Store, *pgxpool.Pool, *logtest.Buffer) {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE effects (id text NOT NULL, n serial)`); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	logger, logs := logtest.New()
	c := newConsumer(t, st, append([]engine.Option{engine.WithLogger(logger)}, eopts...),
		consumer.WithAtomic(), consumer.WithBackoff(10*time.Millisecond, 80*time.Millisecond))
	t.Cleanup(func() {
		for _, raw := range []string{"msg-secret-id", "tenant-secret", "body-secret"} {
			if strings.Contains(logs.String(), raw) {
				t.Errorf("the logs hold %q:\n%s", raw, logs)
			}
		}
	})
	return c, st, pool, logs
}

// effects lists the ids written to effects, in the order written.
func effects(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, _ := pool.Query(t.Context(), `SELECT id FROM effects ORDER BY n`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// writeEffect writes message i's id to effects in the batch's
// transaction, then fails as fail says.
func writeEffect(ds []consumer.Delivery, fail map[string]error) batchHandler {
	return func(ctx context.Context, i int) error {
		tx, ok := postgres.TxFromContext(ctx)
		if !ok {
			return consumer.Final(errors.New("no transaction"))
		}
		if _, err := tx.Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, ds[i].ID); err != nil {
			return err
		}
		return fail[ds[i].ID]
	}
}

// writeEffectAlone writes message i's id to effects in a transaction of
// its own, as a two-phase handler does.
func writeEffectAlone(pool *pgxpool.Pool, ds []consumer.Delivery) batchHandler {
	return func(ctx context.Context, i int) error {
		_, err := pool.Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, ds[i].ID)
		return err
	}
}

// In atomic mode, a batch's writes are each message's own: those of a
// message that failed, for good or for now, are undone alone, and the
// others commit with their records.
func TestBatchAtomicWrites(t *testing.T) {
	c, _, pool, _ := atomicConsumer(t)
	ds := deliveries(1, "msg-secret-id-1", "msg-secret-id-final", "msg-secret-id-2", "msg-secret-id-transient", "msg-secret-id-bad", "msg-secret-id-3")
	fail := map[string]error{
		"msg-secret-id-final":     status.Error(codes.FailedPrecondition, "declined"),
		"msg-secret-id-transient": errors.New("down"),
	}
	write := writeEffect(ds, fail)
	rs := c.handleBatch(t.Context(), ds, func(ctx context.Context, i int) error {
		if err := write(ctx, i); err != nil || ds[i].ID != "msg-secret-id-bad" {
			return err
		}
		// A handler that succeeds after a statement of its failed: its
		// writes cannot commit.
		tx, _ := postgres.TxFromContext(ctx)
		tx.Exec(ctx, `INSERT INTO effects (id) VALUES (NULL)`)
		return nil
	})
	wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Failed, consumer.Processed, consumer.Retry, consumer.StoreFailed, consumer.Processed)
	if got, want := effects(t, pool), []string{"msg-secret-id-1", "msg-secret-id-2", "msg-secret-id-3"}; !slices.Equal(got, want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
	ds = deliveries(2, "msg-secret-id-1", "msg-secret-id-final", "msg-secret-id-transient", "msg-secret-id-bad")
	rs = c.handleBatch(t.Context(), ds, writeEffect(ds, nil))
	wantOutcomes(t, "redelivery", rs, consumer.Duplicate, consumer.Duplicate, consumer.Processed, consumer.Processed)
	if got, want := effects(t, pool), []string{"msg-secret-id-1", "msg-secret-id-2", "msg-secret-id-3", "msg-secret-id-transient", "msg-secret-id-bad"}; !slices.Equal(got, want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
}

// Two consumers take batches of the same ids at once, again and again
// until every message is acknowledged: each id's effect is written once, in
// atomic mode and in two-phase mode (whose handler writes on its own).
func TestBatchRace(t *testing.T) {
	t.Run("atomic", func(t *testing.T) {
		c, st, pool, _ := atomicConsumer(t)
		other := newConsumer(t, st, []engine.Option{engine.WithLogger(nil)}, consumer.WithAtomic())
		testBatchRace(t, pool, c, other, func(ds []consumer.Delivery) batchHandler { return writeEffect(ds, nil) })
	})
	t.Run("two-phase", func(t *testing.T) {
		_, st, pool, _ := atomicConsumer(t)
		var cs [2]*testConsumer
		for k := range cs {
			cs[k] = newConsumer(t, st, []engine.Option{engine.WithLogger(nil)})
		}
		testBatchRace(t, pool, cs[0], cs[1], func(ds []consumer.Delivery) batchHandler { return writeEffectAlone(pool, ds) })
	})
}

func testBatchRace(t *testing.T, pool *pgxpool.Pool, c, other *testConsumer, handler func([]consumer.Delivery) batchHandler) {
	const n = 64
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("msg-secret-id-%02d", i)
	}
	var (
		mu     sync.Mutex
		counts = map[consumer.Outcome]int{}
	)
	var wg sync.WaitGroup
	for k, c := range []*testConsumer{c, other} {
		wg.Go(func() {
			left := slices.Clone(ids)
			if k == 1 {
				slices.Reverse(left)
			}
			// Until every message is acknowledged, however long the other
			// consumer holds ids on a busy machine: a generous bound.
			deadline := time.Now().Add(time.Minute)
			for attempt := 1; len(left) > 0; attempt++ {
				if time.Now().After(deadline) {
					t.Errorf("consumer %d: %d messages still not acknowledged after a minute", k, len(left))
					return
				}
				if attempt > 1 {
					time.Sleep(time.Millisecond) // a redelivery, however soon
				}
				ds := deliveries(attempt, left...)
				rs := c.handleBatch(context.Background(), ds, handler(ds))
				left = left[:0]
				mu.Lock()
				for i, r := range rs {
					counts[r.Outcome]++
					if r.Action != consumer.Ack {
						left = append(left, ds[i].ID)
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	got := effects(t, pool)
	slices.Sort(got)
	if !slices.Equal(got, ids) {
		t.Fatalf("effects %v, want each id once", got)
	}
	if counts[consumer.Processed] != n || counts[consumer.Duplicate] != n {
		t.Fatalf("outcomes %v, want %d processed and %d duplicates", counts, n, n)
	}
}

// Another call records an id of the batch between the batch's read and its
// commit (here a two-phase reservation of it, which takes no advisory
// lock): nothing of the batch commits, and its messages are processed again
// on their own.
func TestBatchSuperseded(t *testing.T) {
	c, st, pool, logs := atomicConsumer(t)
	ds := deliveries(1, "msg-secret-id-1", "msg-secret-id-2", "msg-secret-id-3")
	runs := map[string]int{}
	write := writeEffect(ds, nil)
	rs := c.handleBatch(t.Context(), ds, func(ctx context.Context, i int) error {
		runs[ds[i].ID]++
		if i == 0 && runs[ds[i].ID] == 1 {
			key := store.ScopeKey(ds[1].Tenant, "charges", ds[1].ID)
			if _, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: sha256.Sum256(ds[1].Body), Lease: time.Minute, Retention: time.Hour}); err != nil {
				return err
			}
		}
		return write(ctx, i)
	})
	// The second message is held by the two-phase reservation.
	wantOutcomes(t, "batch", rs, consumer.Processed, consumer.Busy, consumer.Processed)
	if want := map[string]int{"msg-secret-id-1": 2, "msg-secret-id-2": 1, "msg-secret-id-3": 2}; fmt.Sprint(runs) != fmt.Sprint(want) {
		t.Fatalf("runs %v, want %v", runs, want)
	}
	if got, want := effects(t, pool), []string{"msg-secret-id-1", "msg-secret-id-3"}; !slices.Equal(got, want) {
		t.Fatalf("effects %v, want %v", got, want)
	}
	if !strings.Contains(logs.String(), "another call recorded a key of a batch first") {
		t.Fatalf("the lost batch is not logged:\n%s", logs)
	}
}

// A batch seals the records it commits and opens those it reads, as one
// message at a time does, and runs each message's hook once: an execution
// with the record's size, then a replay for its redelivery.
func TestBatchSealedWithHooks(t *testing.T) {
	for _, mode := range []string{"atomic", "two-phase"} {
		t.Run(mode, func(t *testing.T) { testBatchSealedWithHooks(t, mode == "atomic") })
	}
}

func testBatchSealedWithHooks(t *testing.T, atomic bool) {
	ring, err := seal.NewKeyRing(bytes.Repeat([]byte{7}, seal.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	events := &hooklog.Log{Operation: "charges"}
	eopts := []engine.Option{engine.WithSealer(ring), engine.WithHooks(events.Hooks())}
	c, st, pool, _ := atomicConsumer(t, eopts...)
	h := writeEffect
	if !atomic {
		c = newConsumer(t, st, append(eopts, engine.WithLogger(nil)))
		h = func(ds []consumer.Delivery, _ map[string]error) batchHandler {
			return writeEffectAlone(pool, ds)
		}
	}
	ds := deliveries(1, "msg-secret-id-1", "msg-secret-id-2")
	wantOutcomes(t, "batch", c.handleBatch(t.Context(), ds, h(ds, nil)), consumer.Processed, consumer.Processed)
	rows, _ := pool.Query(t.Context(), `SELECT outcome FROM idempotency_keys`)
	outcomes, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err != nil || len(outcomes) != 2 {
		t.Fatalf("%d records (%v), want 2", len(outcomes), err)
	}
	for _, o := range outcomes {
		if _, sealed := seal.SealedWith(o); !sealed {
			t.Errorf("a record of the batch is not sealed: %q", o)
		}
	}
	ds = deliveries(2, "msg-secret-id-1", "msg-secret-id-2")
	wantOutcomes(t, "redelivery", c.handleBatch(t.Context(), ds, h(ds, nil)), consumer.Duplicate, consumer.Duplicate)
	if got := effects(t, pool); len(got) != 2 {
		t.Errorf("effects %v, want one per message", got)
	}
	got := events.Events()
	var executed, replayed int
	for _, e := range got {
		switch {
		case strings.HasPrefix(e, "execute executed ack") && !strings.HasSuffix(e, " 0"):
			executed++
		case strings.HasPrefix(e, "replay replayed ack"):
			replayed++
		}
	}
	if executed != 2 || replayed != 2 || len(got) != 4 {
		t.Errorf("hooks ran:\n\t%s\nwant an execution with its size, then a replay, for each message", strings.Join(got, "\n\t"))
	}
}

// storeOps counts the store's operations that reader saw, by
// idemkey.store.operation.
func storeOps(t *testing.T, reader *sdkmetric.ManualReader) map[string]uint64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(t.Context(), &rm); err != nil {
		t.Fatal(err)
	}
	ops := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.store.duration" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				op, _ := dp.Attributes.Value("idemkey.store.operation")
				ops[op.AsString()] += dp.Count
			}
		}
	}
	return ops
}

// In two-phase mode on PostgreSQL, a batch reserves its ids in one store
// operation, each with one message's lease, and records each message as
// its handler returns. When the handlers before a message have taken so
// long that its lease may end while its own runs, its id is released and
// the message processed on its own.
func TestBatchTwoPhase(t *testing.T) {
	const n = 8
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("msg-secret-id-%d", i)
	}
	for _, tc := range []struct {
		name  string
		pause time.Duration // of the first handler
		alone uint64        // messages processed on their own
	}{
		{"fast handlers", 0, 0},
		// The lease's grace is 5 s; a message runs in the batch while
		// less than half of it has passed.
		{"a slow first handler", 2600 * time.Millisecond, n - 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reader := sdkmetric.NewManualReader()
			st, pool := pgStoreAndPool(t)
			const timeout = 10 * time.Second
			c := newConsumer(t, st, []engine.Option{engine.WithLogger(nil),
				engine.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))}, consumer.WithHandlerTimeout(timeout))
			var leases []time.Duration // of the ids in progress, when the first handler runs
			h := &batchCounter{ds: deliveries(1, ids...)}
			rs := c.handleBatch(t.Context(), h.ds, func(ctx context.Context, i int) error {
				if i == 0 {
					rows, _ := pool.Query(ctx, `SELECT (extract(epoch FROM lease_end - created_at) * 1e6)::bigint FROM idempotency_keys WHERE state = 'in_progress'`)
					us, err := pgx.CollectRows(rows, pgx.RowTo[int64])
					if err != nil {
						return err
					}
					for _, u := range us {
						leases = append(leases, time.Duration(u)*time.Microsecond)
					}
					time.Sleep(tc.pause)
				}
				return h.handle(ctx, i)
			})
			for i, r := range rs {
				if r.Outcome != consumer.Processed {
					t.Fatalf("message %d: %+v, want processed", i, r)
				}
			}
			if !slices.Equal(h.runs, ids) {
				t.Fatalf("handlers ran for %v, want each message once, in order", h.runs)
			}
			ops := storeOps(t, reader)
			if ops["reserve_batch"] != 1 || ops["release"] != tc.alone || ops["reserve"] != tc.alone || ops["complete"] != n {
				t.Fatalf("store operations %v; want 1 reserve_batch, %d release and reserve, and %d complete", ops, tc.alone, n)
			}
			if len(leases) != n {
				t.Fatalf("%d ids in progress when the first handler ran, want %d", len(leases), n)
			}
			for j, l := range leases {
				if l < timeout || l > timeout+6*time.Second {
					t.Errorf("id %d's lease is %v, want the handler timeout %v and the grace", j, l, timeout)
				}
			}
			rs = c.handleBatch(t.Context(), deliveries(2, ids...), h.handle)
			wantOutcomes(t, "redelivery", rs, slices.Repeat([]consumer.Outcome{consumer.Duplicate}, n)...)
		})
	}
}
