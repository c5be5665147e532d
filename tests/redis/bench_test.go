package redis_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// outcome is about the size of a recorded CreateCharge reply.
var outcome = make([]byte, 120)

func first(ctx context.Context, st store.Store, key store.Key) error {
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: 24 * time.Hour})
	if err != nil {
		return err
	}
	if res.State != store.Acquired {
		return fmt.Errorf("reserve of a new key: %v", res.State)
	}
	return st.Complete(ctx, key, res.Token, outcome)
}

func replay(ctx context.Context, st store.Store, key store.Key) error {
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: 24 * time.Hour})
	if err == nil && res.State != store.Completed {
		err = fmt.Errorf("reserve of a recorded key: %v", res.State)
	}
	return err
}

// BenchmarkWait measures what WithReplicas(1) costs a first call (Reserve
// and Complete) and a replay, on a primary with one replica started by the
// benchmark on this machine, interleaved with the same calls that do not
// wait. It reports the waiting call's time as a ratio to the other's.
func BenchmarkWait(b *testing.B) {
	primary, _ := redistest.Replicated(b)
	client := primary.Client(b)
	ctx := context.Background()
	p := prefix()
	plain, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}
	waiting, err := redis.New(ctx, client, redis.WithPrefix(p), redis.WithReplicas(1))
	if err != nil {
		b.Fatal(err)
	}
	key := func(kind string, i int) store.Key { return store.ScopeKey("bench", kind, strconv.Itoa(i)) }
	for i := range 1000 { // for the replays
		if err := first(ctx, plain, key("r", i)); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("first", func(b *testing.B) {
		run := prefix() // new keys on every run of the benchmark
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "nowait", Run: func(i int) error { return first(ctx, plain, key("fn"+run, i)) }},
			benchtest.Op{Name: "wait1", Run: func(i int) error { return first(ctx, waiting, key("fw"+run, i)) }},
		)
		b.ReportMetric(means[1]/means[0], "wait1/nowait")
	})
	b.Run("replay", func(b *testing.B) {
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "nowait", Run: func(i int) error { return replay(ctx, plain, key("r", i%1000)) }},
			benchtest.Op{Name: "wait1", Run: func(i int) error { return replay(ctx, waiting, key("r", i%1000)) }},
		)
		b.ReportMetric(means[1]/means[0], "wait1/nowait")
	})
}

// BenchmarkVsPostgres runs a first call and a replay on the Redis store (one
// server, no replica) and on the PostgreSQL store, interleaved, and reports
// Redis's time as a ratio to PostgreSQL's.
func BenchmarkVsPostgres(b *testing.B) {
	ctx := context.Background()
	rst, err := redis.New(ctx, redistest.Client(b), redis.WithPrefix(prefix()))
	if err != nil {
		b.Fatal(err)
	}
	schema := pgtest.Schema(b)
	pool := pgtest.Pool(b, schema)
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pst, err := postgres.New(pool)
	if err != nil {
		b.Fatal(err)
	}
	key := func(kind string, i int) store.Key { return store.ScopeKey("bench", kind, strconv.Itoa(i)) }
	for i := range 1000 {
		if err := first(ctx, rst, key("r", i)); err != nil {
			b.Fatal(err)
		}
		if err := first(ctx, pst, key("r", i)); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("first", func(b *testing.B) {
		run := prefix() // new keys on every run of the benchmark
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "postgres", Run: func(i int) error { return first(ctx, pst, key("f"+run, i)) }},
			benchtest.Op{Name: "redis", Run: func(i int) error { return first(ctx, rst, key("f"+run, i)) }},
		)
		b.ReportMetric(means[1]/means[0], "redis/postgres")
	})
	b.Run("replay", func(b *testing.B) {
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "postgres", Run: func(i int) error { return replay(ctx, pst, key("r", i%1000)) }},
			benchtest.Op{Name: "redis", Run: func(i int) error { return replay(ctx, rst, key("r", i%1000)) }},
		)
		b.ReportMetric(means[1]/means[0], "redis/postgres")
	})
}

// BenchmarkCalls runs a first call (Reserve and Complete), a replay and a
// bare round trip of go-redis (PING) on one server, interleaved, and
// reports what each call of the store adds to the bare round trip and its
// time as a ratio to it: a change to the store's command path shows in the
// ratios, which the machine's load moves less than the times. Then, each
// run on its own, what each costs the server in CPU ("-server-µs") and
// this process ("-cpu-µs"): the rest of a call's time is spent
// waiting, on the loopback and for the scheduler.
func BenchmarkCalls(b *testing.B) {
	ctx := context.Background()
	client := redistest.Client(b)
	st, err := redis.New(ctx, client, redis.WithPrefix(prefix()))
	if err != nil {
		b.Fatal(err)
	}
	key := func(kind string, i int) store.Key { return store.ScopeKey("bench", kind, strconv.Itoa(i)) }
	for i := range 1000 { // for the replays
		if err := first(ctx, st, key("r", i)); err != nil {
			b.Fatal(err)
		}
	}
	run := prefix() // new keys on every run of the benchmark
	ops := []benchtest.Op{
		{Name: "ping", Run: func(int) error { return client.Ping(ctx).Err() }},
		{Name: "first", Run: func(i int) error { return first(ctx, st, key("f"+run, i)) }},
		{Name: "replay", Run: func(i int) error { return replay(ctx, st, key("r", i%1000)) }},
	}
	ns := benchtest.Interleave(b, ops...)
	allocRun := prefix()
	allocs := benchtest.Allocs(b, 200, ops[0],
		benchtest.Op{Name: "first", Run: func(i int) error { return first(ctx, st, key("a"+allocRun, i)) }},
		ops[2])
	benchtest.ReportAdded(b, ops, ns, allocs)
	for _, op := range []benchtest.Op{ops[0],
		{Name: "first", Run: func(i int) error { return first(ctx, st, key("c"+allocRun, i)) }},
		ops[2]} {
		server, cpu := spent(b, client, 2000, op)
		b.ReportMetric(server, op.Name+"-server-µs")
		b.ReportMetric(cpu, op.Name+"-cpu-µs")
	}
}

// spent runs op runs times, one after the other, and returns the mean CPU
// time per run of the server (INFO cpu: its reads and writes of the
// sockets, the scripts) and of this process (its every goroutine's, the
// runtime's too), in microseconds: what a call costs each side, apart from
// the waits between.
func spent(b *testing.B, client *goredis.Client, runs int, op benchtest.Op) (server, cpu float64) {
	b.Helper()
	serverBefore, cpuBefore := serverMicros(b, client), processMicros(b)
	for i := range runs {
		if err := op.Run(i); err != nil {
			b.Fatalf("%s: %v", op.Name, err)
		}
	}
	cpuAfter, serverAfter := processMicros(b), serverMicros(b, client)
	return float64(serverAfter-serverBefore) / float64(runs), float64(cpuAfter-cpuBefore) / float64(runs)
}

// serverMicros is the CPU time the server has used (INFO cpu), user and
// system, its every thread's.
func serverMicros(b *testing.B, client *goredis.Client) int64 {
	info, err := client.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total int64
	for line := range strings.Lines(info) {
		name, value, _ := strings.Cut(strings.TrimSpace(line), ":")
		if name != "used_cpu_user" && name != "used_cpu_sys" {
			continue
		}
		seconds, err := strconv.ParseFloat(value, 64)
		if err != nil {
			b.Fatalf("INFO cpu: %q", line)
		}
		total += int64(seconds * 1e6)
	}
	return total
}

// processMicros is the CPU time this process has used, user and system.
func processMicros(b *testing.B) int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Utime.Nano()/1e3 + ru.Stime.Nano()/1e3
}

// BenchmarkStepWrites is benchtest.StepWrites on Redis: a step's two
// writes, and a renewal's one, against a first call's.
func BenchmarkStepWrites(b *testing.B) {
	st, err := redis.New(context.Background(), redistest.Client(b), redis.WithPrefix(prefix()))
	if err != nil {
		b.Fatal(err)
	}
	benchtest.StepWrites(b, st)
}
