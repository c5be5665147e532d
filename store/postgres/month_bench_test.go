package postgres_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// A month of keys: 10^8 rows is about 37 days of keys at 31 calls a second,
// or 31 days of a service that records 3.2 million keys a day.
const (
	monthRows   = 100_000_000
	monthSchema = "idemkey_bench_month"
	// hourRows is an hour's expiring keys when monthRows are kept 31 days.
	hourRows = monthRows / (31 * 24)
)

var month = flag.Bool("month", false, "run the Month benchmarks on a table of 10^8 rows: "+
	"about 40 GB and most of an hour to fill, kept in schema "+monthSchema+" for the next run (DROP SCHEMA "+monthSchema+" CASCADE frees it)")

// monthStore returns a store on the table of 10^8 completed records in
// monthSchema, filling it first unless a run before this one finished
// doing so: the i-th row is filledKey(i)'s, as filledStore's, created over
// the last 31 days, each kept 62 days so that a run within a month of the
// fill finds every row live.
func monthStore(b *testing.B) *postgres.Store {
	b.Helper()
	if !*month {
		b.Skip("the Month benchmarks need -month: a table of 10^8 rows, about 40 GB")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	mark := fmt.Sprint("filled with ", monthRows, " rows")
	var filled bool
	if err := conn.QueryRow(ctx, `SELECT coalesce(obj_description(to_regclass($1), 'pg_class') = $2, false)`,
		monthSchema+".idempotency_keys", mark).Scan(&filled); err != nil {
		b.Fatal(err)
	}
	if !filled {
		fillMonth(b, conn, mark)
	}
	return newStore(b, pgtest.Pool(b, monthSchema))
}

// fillMonth makes monthSchema anew and fills it in ten statements of a
// tenth each, so that the log tells the progress, then builds the indexes:
// many times faster than keeping them up to date row by row.
func fillMonth(b *testing.B, conn *pgx.Conn, mark string) {
	ctx := context.Background()
	start := time.Now()
	for _, sql := range []string{
		`DROP SCHEMA IF EXISTS ` + monthSchema + ` CASCADE`,
		`CREATE SCHEMA ` + monthSchema,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	pool := pgtest.Pool(b, monthSchema)
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pool.Close()
	fp := store.Fingerprint{1}
	table := monthSchema + ".idempotency_keys"
	for _, sql := range []string{
		`SET maintenance_work_mem = '2GB'`,
		`ALTER TABLE ` + table + ` DROP CONSTRAINT idempotency_keys_pkey`,
		`DROP INDEX ` + monthSchema + `.idempotency_keys_expires_at_idx`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	const parts = 10
	for part := range parts {
		from, to := part*monthRows/parts, (part+1)*monthRows/parts
		if _, err := conn.Exec(ctx, `INSERT INTO `+table+`
			SELECT sha256(convert_to('filled-' || i, 'UTF8')), $3, 'completed', i, created, $4, created, created + interval '62 days'
			FROM generate_series($1::bigint, $2::bigint - 1) AS i,
				LATERAL (SELECT now() - (i % 2678400) * interval '1 second' AS created) AS c`,
			from, to, fp[:], outcome); err != nil {
			b.Fatal(err)
		}
		b.Logf("month: %d of %d rows in, %v", to, monthRows, time.Since(start).Round(time.Second))
	}
	for _, sql := range []string{
		`ALTER TABLE ` + table + ` ADD PRIMARY KEY (key)`,
		`CREATE INDEX idempotency_keys_expires_at_idx ON ` + table + ` (expires_at)`,
		`VACUUM ANALYZE ` + table,
		`COMMENT ON TABLE ` + table + ` IS '` + mark + `'`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
		b.Logf("month: %.40s…, %v", sql, time.Since(start).Round(time.Second))
	}
}

// BenchmarkMonthReserve measures Reserve and Find on the month's 10^8 rows
// against a table of 10^6, interleaved as BenchmarkReserveScale: per
// iteration, on each table, the reserve of a new key, of a recorded key at
// random over the whole table, and of the key the iteration before
// recorded, and the Find of a random and of that recent key. It reports
// each one's median and the ratio of the medians, 10^8 over 10^6.
func BenchmarkMonthReserve(b *testing.B) {
	monthScale(b, "insert", "replay", "replay-recent", "find", "find-recent")
}

// BenchmarkMonthRecent is BenchmarkMonthReserve without the random keys:
// new keys, and retries of the key just recorded, as a service sees whose
// retries come within the hour. Its index of keys is first read into the
// operating system's cache (pg_prewarm), as a month of inserts into it
// keeps it there on a server with memory for it, rather than the pages of
// random month-old records that BenchmarkMonthReserve reads.
func BenchmarkMonthRecent(b *testing.B) {
	large := monthStore(b)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, sql := range []string{
		`CREATE EXTENSION IF NOT EXISTS pg_prewarm`,
		`SELECT pg_prewarm('` + monthSchema + `.idempotency_keys_pkey', 'read')`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	monthScaleOn(b, large, "insert", "replay-recent", "find-recent")
}

// monthScale runs kinds of calls interleaved on a table of 10^6 rows and
// the month's, and reports their medians and ratios.
func monthScale(b *testing.B, kinds ...string) {
	monthScaleOn(b, monthStore(b), kinds...)
}

func monthScaleOn(b *testing.B, large *postgres.Store, kinds ...string) {
	small := filledStore(b, 1_000_000)
	stores := []*postgres.Store{small, large}
	sizes := []int{1_000_000, monthRows}
	ctx := context.Background()
	fp := store.Fingerprint{1}
	latencies := make([][][]time.Duration, len(stores))
	for i := range latencies {
		latencies[i] = make([][]time.Duration, len(kinds))
	}
	run := rand.Uint64()
	newKey := func(n int) store.Key { return benchKey(fmt.Sprintf("month-%x", run), n) }
	n := 0
	for b.Loop() {
		for j := range len(kinds) * len(stores) {
			op := (n + j) % (len(kinds) * len(stores))
			size, kind := op/len(kinds), op%len(kinds)
			st := stores[size]
			key := newKey(n)
			switch kinds[kind] {
			case "replay", "find":
				key = filledKey(rand.IntN(sizes[size]))
			case "replay-recent", "find-recent":
				if n == 0 {
					continue
				}
				key = newKey(n - 1)
			}
			start := time.Now()
			var (
				res store.Entry
				err error
			)
			switch kinds[kind] {
			case "find", "find-recent":
				var ok bool
				res, ok, err = st.Find(ctx, key)
				if err == nil && (!ok || res.State != store.Completed) {
					err = fmt.Errorf("find of a recorded key: %v, %v", ok, res.State)
				}
			default:
				want := store.Completed
				if kinds[kind] == "insert" {
					want = store.Acquired
				}
				res, err = st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: fp, Lease: time.Minute, Retention: 24 * time.Hour})
				if err == nil && res.State != want {
					err = fmt.Errorf("reserve: %v, want %v", res.State, want)
				}
			}
			took := time.Since(start)
			if err != nil {
				b.Fatal(err)
			}
			latencies[size][kind] = append(latencies[size][kind], took)
			if kinds[kind] == "insert" { // untimed: recorded, for the next iteration's replay of it
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
	for kind, name := range kinds {
		if len(latencies[0][kind]) == 0 || len(latencies[1][kind]) == 0 {
			continue // a single iteration has no recent record
		}
		lo, hi := median(latencies[0][kind]), median(latencies[1][kind])
		b.ReportMetric(lo, name+"-p50-ns@1e6")
		b.ReportMetric(hi, name+"-p50-ns@1e8")
		b.ReportMetric(hi/lo, name+"-p50-1e8/1e6")
	}
}

// BenchmarkMonthSweep measures the sweeper on the month's 10^8 rows: each
// iteration adds an hour's expired keys of a 31-day retention (hourRows,
// the hour's sweep) and sweeps them unpaced, then adds as many again and
// sweeps them paced at a share of 0.05 (postgres.WithSweepShare), while
// four goroutines make first calls throughout. It reports an hour's sweep's
// time unpaced (its statements' time: the database's cost of an hour of
// expiry) and paced, their ratio (the paced sweep's own statements take at
// most the share of its time, by construction), and the live calls' p99 in
// the second before each sweep and during it.
func BenchmarkMonthSweep(b *testing.B) {
	const share, callers = 0.05, 4
	ctx := context.Background()
	unpaced := monthStore(b)
	paced := newStore(b, pgtest.Pool(b, monthSchema), postgres.WithSweepShare(share))
	fp := store.Fingerprint{1}
	// sweep adds an hour of expired keys, measures the live calls for a
	// second, then sweeps with st while they go on.
	pool := pgtest.Pool(b, monthSchema)
	run := rand.Uint64()
	sweep := func(st *postgres.Store, name string) (took time.Duration, quiet, sweeping float64) {
		if _, err := pool.Exec(ctx, `INSERT INTO idempotency_keys
			SELECT sha256(convert_to($1 || i, 'UTF8')), $2, 'completed', i, now() - interval '32 days', $3,
				now() - interval '32 days', now() - interval '1 day'
			FROM generate_series(1, $4) AS i`, fmt.Sprintf("expired-%x-%s-", run, name), fp[:], outcome, hourRows); err != nil {
			b.Fatal(err)
		}
		stop := make(chan struct{})
		time.AfterFunc(time.Second, func() { close(stop) })
		quiet = p99(liveFirstCalls(b, unpaced, callers, name+"-quiet", stop))
		stop = make(chan struct{})
		latencies := make(chan []time.Duration)
		go func() { latencies <- liveFirstCalls(b, unpaced, callers, name+"-sweeping", stop) }()
		start := time.Now()
		deleted, err := st.Sweep(ctx, store.DefaultSweepBatch)
		took = time.Since(start)
		close(stop)
		sweeping = p99(<-latencies)
		if err != nil || deleted < hourRows {
			b.Fatalf("Sweep deleted %d of %d expired records: %v", deleted, hourRows, err)
		}
		return took, quiet, sweeping
	}
	var sums [6]float64
	n := 0
	for b.Loop() {
		took, quiet, sweeping := sweep(unpaced, fmt.Sprintf("%x-unpaced-%d", run, n))
		tookPaced, quietPaced, sweepingPaced := sweep(paced, fmt.Sprintf("%x-paced-%d", run, n))
		for i, v := range []float64{took.Seconds(), tookPaced.Seconds(), quiet, sweeping, quietPaced, sweepingPaced} {
			sums[i] += v
		}
		n++
	}
	avg := func(i int) float64 { return sums[i] / float64(n) }
	b.ReportMetric(avg(0), "hour-sweep-s")
	b.ReportMetric(avg(1), "hour-sweep-paced-s")
	b.ReportMetric(avg(0)/avg(1), "unpaced/paced")
	b.ReportMetric(avg(0)/3600, "unpaced-share-of-hour")
	b.ReportMetric(avg(3)/avg(2), "p99-sweeping/quiet")
	b.ReportMetric(avg(5)/avg(4), "p99-paced/quiet")
}
