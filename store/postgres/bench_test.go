package postgres_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// outcome is about the size of a recorded CreateCharge reply.
var outcome = make([]byte, 120)

// baseline is the minimal SQL of the store's design, written by hand on the
// same pool and a table of the same schema: a first call inserts or does
// nothing, then updates by primary key; a replay selects by primary key.
type baseline struct {
	pool *pgxpool.Pool
}

func (bl baseline) first(ctx context.Context, key store.Key, fp store.Fingerprint) error {
	var token int64
	err := bl.pool.QueryRow(ctx, `INSERT INTO baseline_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
		VALUES ($1, $2, 'in_progress', nextval('baseline_keys_token_seq'), now() + interval '1 minute', now(), now() + interval '1 day')
		ON CONFLICT DO NOTHING RETURNING token`, key[:], fp[:]).Scan(&token)
	if err != nil {
		return err
	}
	_, err = bl.pool.Exec(ctx, `UPDATE baseline_keys SET state = 'completed', outcome = $3 WHERE key = $1 AND token = $2`, key[:], token, outcome)
	return err
}

func (bl baseline) replay(ctx context.Context, key store.Key) error {
	var (
		state    string
		fp, out  []byte
		leaseEnd time.Time
	)
	return bl.pool.QueryRow(ctx, `SELECT state, fingerprint, outcome, lease_end FROM baseline_keys WHERE key = $1`, key[:]).
		Scan(&state, &fp, &out, &leaseEnd)
}

func first(ctx context.Context, st *postgres.Store, key store.Key, fp store.Fingerprint) error {
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: 24 * time.Hour})
	if err != nil {
		return err
	}
	if res.State != store.Acquired {
		return fmt.Errorf("reserve of a new key: %v", res.State)
	}
	return st.Complete(ctx, key, res.Token, outcome)
}

func replay(ctx context.Context, st *postgres.Store, key store.Key, fp store.Fingerprint) error {
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: 24 * time.Hour})
	if err == nil && res.State != store.Completed {
		err = fmt.Errorf("reserve of a recorded key: %v", res.State)
	}
	return err
}

func benchKey(prefix string, i int) store.Key {
	return store.ScopeKey("tenant", "/bench.v1.Bench/Call", fmt.Sprintf("%s-%d", prefix, i))
}

// BenchmarkStoreVsBaseline runs the store and the hand-written baseline
// interleaved, one of each operation per iteration in rotating order, so that
// noise (a WAL flush that takes longer) hits both alike: a first call, a
// replay, and the store's replay of a retried call (Find). It reports each
// operation's time and the store's ratio to the baseline.
func BenchmarkStoreVsBaseline(b *testing.B) {
	schema := pgtest.Schema(b)
	pool := pgtest.Pool(b, schema)
	ctx := context.Background()
	for _, table := range []string{postgres.DefaultTable, "baseline_keys"} {
		if err := postgres.Migrate(ctx, pool, postgres.WithTable(table)); err != nil {
			b.Fatal(err)
		}
	}
	st := newStore(b, pool)
	bl := baseline{pool}
	fp := store.Fingerprint{1}
	// As in a gRPC handler, whose context can always be cancelled, pgx
	// watches the context of every statement on both paths.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	replayKey := benchKey("replay", 0)
	if err := first(ctx, st, replayKey, fp); err != nil {
		b.Fatal(err)
	}
	if err := bl.first(ctx, replayKey, fp); err != nil {
		b.Fatal(err)
	}
	ns := benchtest.Interleave(b,
		benchtest.Op{Name: "baseline-first", Run: func(i int) error { return bl.first(ctx, benchKey("first", i), fp) }},
		benchtest.Op{Name: "store-first", Run: func(i int) error { return first(ctx, st, benchKey("first", i), fp) }},
		benchtest.Op{Name: "baseline-replay", Run: func(int) error { return bl.replay(ctx, replayKey) }},
		benchtest.Op{Name: "store-replay", Run: func(int) error { return replay(ctx, st, replayKey, fp) }},
		benchtest.Op{Name: "store-find", Run: func(int) error { return find(ctx, st, replayKey) }},
	)
	b.ReportMetric(ns[1]/ns[0], "first/baseline")
	b.ReportMetric(ns[3]/ns[2], "replay/baseline")
	b.ReportMetric(ns[4]/ns[2], "find/baseline")
}

// find is the replay of a call that gRPC marks as a retry: the engine
// asks Find first.
func find(ctx context.Context, st *postgres.Store, key store.Key) error {
	res, found, err := st.Find(ctx, key)
	if err == nil && (!found || res.State != store.Completed) {
		err = fmt.Errorf("find: found %v, state %v; want a completed record", found, res.State)
	}
	return err
}

// filled caches, for the life of the test binary, one schema per table size:
// filling a million rows takes seconds, and -count repeats benchmarks.
// TestMain drops them.
var filled = struct {
	sync.Mutex
	schemas map[int]string
}{schemas: map[int]string{}}

func dropFilled() {
	filled.Lock()
	defer filled.Unlock()
	for _, schema := range filled.schemas {
		_ = pgtest.DropSchema(schema)
	}
}

// filledKey is the key of the i-th row of a filled table.
func filledKey(i int) store.Key { return sha256.Sum256([]byte("filled-" + strconv.Itoa(i))) }

// filledStore returns a store on a table holding rows completed records, the
// i-th under filledKey(i) with fingerprint {1}.
func filledStore(b *testing.B, rows int) *postgres.Store {
	b.Helper()
	filled.Lock()
	defer filled.Unlock()
	schema, ok := filled.schemas[rows]
	if !ok {
		var err error
		if schema, err = pgtest.CreateSchema(); err != nil {
			b.Fatal(err)
		}
		filled.schemas[rows] = schema
		pool := pgtest.Pool(b, schema)
		ctx := context.Background()
		if err := postgres.Migrate(ctx, pool); err != nil {
			b.Fatal(err)
		}
		// The indexes are built after the rows are in: maintaining them
		// row by row, with random keys, would take many times longer.
		fp := store.Fingerprint{1}
		for _, sql := range []string{
			`ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey`,
			`DROP INDEX idempotency_keys_expires_at_idx`,
			`INSERT INTO idempotency_keys
				SELECT sha256(convert_to('filled-' || i, 'UTF8')), $2, 'completed', i, now(), $3, now(), now() + interval '1 day'
				FROM generate_series(0, $1 - 1) AS i`,
			`ALTER TABLE idempotency_keys ADD PRIMARY KEY (key)`,
			`CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at)`,
			`VACUUM ANALYZE idempotency_keys`,
		} {
			var args []any
			if strings.HasPrefix(sql, "INSERT") {
				args = []any{rows, fp[:], outcome}
			}
			if _, err := pool.Exec(ctx, sql, args...); err != nil {
				b.Fatal(err)
			}
		}
	}
	return newStore(b, pgtest.Pool(b, schema))
}

// BenchmarkReserveScale measures Reserve's latency on tables of 10^4, 10^6
// and 10^7 rows, interleaved as above: per iteration, on each table, the
// reserve of a new key (an insert), of a recorded key picked at random over
// the whole table (a replay, the worst case for the caches), and of the key
// the previous iteration inserted and recorded (a recent replay, as most
// retries are). It reports each one's median and the ratio of the medians to
// that of 10^4 rows. Filling 10^7 rows takes minutes and some 5 GB, once per run
// of the test binary.
func BenchmarkReserveScale(b *testing.B) {
	sizes := []int{10_000, 1_000_000, 10_000_000}
	stores := make([]*postgres.Store, len(sizes))
	for i, rows := range sizes {
		stores[i] = filledStore(b, rows)
	}
	ctx := context.Background()
	fp := store.Fingerprint{1}
	reserve := func(st *postgres.Store, key store.Key, want store.State) (store.Entry, error) {
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: 24 * time.Hour})
		if err == nil && res.State != want {
			err = fmt.Errorf("reserve: %v, want %v", res.State, want)
		}
		return res, err
	}
	const kinds = 3 // insert, replay of a random record, replay of the last insert
	latencies := make([][kinds][]time.Duration, len(sizes))
	run := rand.Uint64()
	newKey := func(n int) store.Key { return benchKey(fmt.Sprintf("new-%x", run), n) }
	n := 0
	for b.Loop() {
		for j := range kinds * len(sizes) {
			op := (n + j) % (kinds * len(sizes))
			size, kind := op/kinds, op%kinds
			st := stores[size]
			key, want := newKey(n), store.Acquired
			switch kind {
			case 1:
				key, want = filledKey(rand.IntN(sizes[size])), store.Completed
			case 2:
				if n == 0 {
					continue
				}
				key, want = newKey(n-1), store.Completed
			}
			start := time.Now()
			res, err := reserve(st, key, want)
			if err != nil {
				b.Fatal(err)
			}
			latencies[size][kind] = append(latencies[size][kind], time.Since(start))
			if kind == 0 { // untimed: recorded, for the next iteration's replay of it
				if err := st.Complete(ctx, key, res.Token, outcome); err != nil {
					b.Fatal(err)
				}
			}
		}
		n++
	}
	median := func(ds []time.Duration) float64 {
		slices.Sort(ds)
		return float64(ds[len(ds)/2].Nanoseconds())
	}
	for kind, name := range []string{"insert", "replay", "replay-recent"} {
		if len(latencies[0][kind]) == 0 {
			continue // a single iteration has no recent record to replay
		}
		small := median(latencies[0][kind])
		b.ReportMetric(small, name+"-p50-ns@1e4")
		for i, size := range []string{"1e6", "1e7"} {
			large := median(latencies[i+1][kind])
			b.ReportMetric(large, name+"-p50-ns@"+size)
			b.ReportMetric(large/small, name+"-p50-"+size+"/1e4")
		}
	}
}

// BenchmarkInterceptor measures CreateCharge over bufconn with a handler that
// does no work of its own, interleaved in rotating order: bare (no
// interceptor), and behind the interceptor on this store in two-phase and in
// atomic mode, each as a first call (a new key), as a replay, and as a
// replay and a first call that gRPC marks as a retry (AttemptsMetadata),
// which the engine looks up first. Every call checks that it was, or was
// not, a replay. It reports
// each one's time and its ratio to bare: what idemkey adds to a call.
func BenchmarkInterceptor(b *testing.B) {
	pool := pgtest.Pool(b, pgtest.Schema(b))
	if err := postgres.Migrate(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	st := newStore(b, pool)
	serve := func(interceptors ...grpc.UnaryServerInterceptor) paymentsv1.PaymentServiceClient {
		srv := grpc.NewServer(grpc.ChainUnaryInterceptor(interceptors...))
		paymentsv1.RegisterPaymentServiceServer(srv, &chargeService{})
		return paymentsv1.NewPaymentServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
	}
	bare := serve()
	twoPhase := serve(grpctest.Interceptor(st))
	atomic := serve(grpctest.Interceptor(st, interceptor.WithAtomic()))
	// call calls CreateCharge on client with the recorded key "replayed", or
	// with a new key of its own if op names one, marked as a later attempt of
	// gRPC's retry policy if retry is set (the engine then looks the
	// record up first: store.Finder), and fails unless the reply is a replay
	// exactly when it should be.
	run := idemkey.NewKey()
	call := func(client paymentsv1.PaymentServiceClient, op string, retry bool) func(int) error {
		return func(i int) error {
			key := "replayed"
			if op != "" {
				key = fmt.Sprint(run, "-", op, "-", i)
			}
			pairs := []string{idemkey.KeyMetadata, key}
			if retry {
				pairs = append(pairs, interceptor.AttemptsMetadata, "1")
			}
			var trailer metadata.MD
			ctx := metadata.AppendToOutgoingContext(context.Background(), pairs...)
			if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: 1}, grpc.Trailer(&trailer)); err != nil {
				return err
			}
			if client != bare && idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) != (op == "") {
				return fmt.Errorf("key %q: replayed %v", key, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
			return nil
		}
	}
	if err := createCharge(twoPhase, "replayed"); err != nil {
		b.Fatal(err)
	}
	ops := []benchtest.Op{
		{Name: "bare", Run: call(bare, "bare", false)},
		{Name: "two-phase-first", Run: call(twoPhase, "two-phase-first", false)},
		{Name: "two-phase-replay", Run: call(twoPhase, "", false)},
		{Name: "atomic-first", Run: call(atomic, "atomic-first", false)},
		{Name: "atomic-replay", Run: call(atomic, "", false)},
		{Name: "two-phase-retry", Run: call(twoPhase, "", true)},
		{Name: "atomic-retry", Run: call(atomic, "", true)},
		{Name: "two-phase-retry-first", Run: call(twoPhase, "two-phase-retry-first", true)},
		{Name: "atomic-retry-first", Run: call(atomic, "atomic-retry-first", true)},
	}
	for _, op := range ops { // connect and prepare
		if err := op.Run(-1); err != nil {
			b.Fatal(err)
		}
	}
	ns := benchtest.Interleave(b, ops...)
	for i := 1; i < len(ops); i++ {
		b.ReportMetric(ns[i]/ns[0], ops[i].Name+"/bare")
	}
}

// BenchmarkSweepUnderLoad measures the sweeper while live traffic runs. Each
// iteration fills the table with 100,000 expired records, runs first calls
// (Reserve, then Complete) from four goroutines for a second without a
// sweep, then again while Sweep deletes the expired records in batches of
// DefaultSweepBatch. It reports the rows deleted per second and the live
// calls' p99 latency without and during the sweep, and their ratio.
func BenchmarkSweepUnderLoad(b *testing.B) {
	const expired, callers = 100_000, 4
	pool := pgtest.Pool(b, pgtest.Schema(b))
	ctx := context.Background()
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	st := newStore(b, pool)
	fp := store.Fingerprint{1}
	var rate, quiet, sweeping float64
	run := 0
	for b.Loop() {
		run++
		if _, err := pool.Exec(ctx, `INSERT INTO idempotency_keys
			SELECT sha256(convert_to($1 || i, 'UTF8')), $2, 'completed', i, now() - interval '2 days', $3,
				now() - interval '2 days', now() - interval '1 day'
			FROM generate_series(1, $4) AS i`, fmt.Sprint("expired-", run, "-"), fp[:], outcome, expired); err != nil {
			b.Fatal(err)
		}
		stop := make(chan struct{})
		time.AfterFunc(time.Second, func() { close(stop) })
		quiet += p99(liveFirstCalls(b, st, callers, fmt.Sprint("live-", run), stop))

		stop = make(chan struct{})
		latencies := make(chan []time.Duration)
		go func() { latencies <- liveFirstCalls(b, st, callers, fmt.Sprint("live-", run+1_000_000), stop) }()
		start := time.Now()
		deleted, err := st.Sweep(ctx, store.DefaultSweepBatch)
		took := time.Since(start)
		close(stop)
		sweeping += p99(<-latencies)
		if err != nil || deleted < expired {
			b.Fatalf("Sweep deleted %d of %d expired records: %v", deleted, expired, err)
		}
		rate += float64(deleted) / took.Seconds()
	}
	b.ReportMetric(rate/float64(run), "swept-rows/s")
	b.ReportMetric(quiet/float64(run), "p99-ns-quiet")
	b.ReportMetric(sweeping/float64(run), "p99-ns-sweeping")
	b.ReportMetric(sweeping/quiet, "p99-sweeping/quiet")
}

// liveFirstCalls makes first calls on st from callers goroutines, each key
// named after name, until stop is closed, and returns their latencies.
func liveFirstCalls(b *testing.B, st *postgres.Store, callers int, name string, stop <-chan struct{}) []time.Duration {
	var (
		mu  sync.Mutex
		all []time.Duration
		wg  sync.WaitGroup
	)
	fp := store.Fingerprint{1}
	for g := range callers {
		wg.Go(func() {
			var mine []time.Duration
			for i := 0; ; i++ {
				select {
				case <-stop:
					mu.Lock()
					all = append(all, mine...)
					mu.Unlock()
					return
				default:
				}
				start := time.Now()
				if err := first(context.Background(), st, benchKey(fmt.Sprintf("%s-%d", name, g), i), fp); err != nil {
					b.Error(err)
				}
				mine = append(mine, time.Since(start))
			}
		})
	}
	wg.Wait()
	return all
}

// p99 is the 99th percentile of ds, in nanoseconds; it sorts ds.
func p99(ds []time.Duration) float64 {
	slices.Sort(ds)
	return float64(ds[len(ds)*99/100].Nanoseconds())
}

// BenchmarkStepWrites is benchtest.StepWrites on PostgreSQL: a step's two
// writes, and a renewal's one, against a first call's.
func BenchmarkStepWrites(b *testing.B) {
	pool := pgtest.Pool(b, pgtest.Schema(b))
	if err := postgres.Migrate(context.Background(), pool); err != nil {
		b.Fatal(err)
	}
	benchtest.StepWrites(b, newStore(b, pool))
}
