package redis_test

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/valkey-io/valkey-go"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

var (
	pipelining           = flag.Bool("pipelining", false, "run BenchmarkPipelining (about 70 s a run with -benchtime=3x), which make bench leaves out")
	pipeliningGoroutines = flag.String("pipelining-goroutines", "1,16,64", "BenchmarkPipelining: how many goroutines call at once, a comma-separated list")
)

// A client under test: first sends the store's Reserve of new key i and then
// its Complete (two EVALSHAs, one after the other, as the engine does with a
// handler between), replay its Reserve of recorded key i%1000.
type pipeClient struct {
	name          string
	first, replay func(ctx context.Context, i int) error
}

// BenchmarkPipelining measures whether a client that pipelines concurrent
// callers' commands would make the store faster. It sends the store's own
// scripts (their SHAs and arguments read from what the store sent, through
// a hook: the same Lua, so that clients are compared and not scripts) from
// 1, 16 and 64 goroutines through:
//
//   - goredis: go-redis as the store uses it (default options: a pool of
//     10 connections a CPU, one command a connection at a time);
//   - goredis-pool: the same with a pool of 128 connections, 64 kept idle;
//   - goredis-auto: go-redis's AutoPipeline (v9.23, experimental), which
//     batches concurrent callers' commands into pipelines;
//   - goredis-fd: the same in its full-duplex mode;
//   - valkey: valkey-go's client with its default options, which
//     pipelines concurrent callers' commands on one connection (RESP3);
//   - store: the store itself, on a client with go-redis's default options;
//   - store-ctx: the same on a client with ContextTimeoutEnabled, on which
//     the store never pipelines.
//
// Each run of the benchmark's loop runs a chunk of calls on each client in
// turn, in rotating order, so that noise hits all alike. It reports, per
// client, calls per second, this process's CPU per call (getrusage: every
// goroutine's, the runtime's), heap allocations per call and the median
// latency, and each as a ratio to goredis's ("valkey-calls/goredis"). It
// runs only with -pipelining.
func BenchmarkPipelining(b *testing.B) {
	if !*pipelining {
		b.Skip("run with -pipelining")
	}
	ctx := context.Background()
	client := redistest.Client(b)
	p := prefix()
	st, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}
	key := func(kind string, i int) store.Key { return store.ScopeKey("bench", kind, strconv.Itoa(i)) }
	name := func(k store.Key) string { return p + ":{" + hex.EncodeToString(k[:]) + "}" }
	replays := make([]string, 1000)
	for i := range replays {
		if err := first(ctx, st, key("r", i)); err != nil {
			b.Fatal(err)
		}
		replays[i] = name(key("r", i))
	}
	run := prefix() // new keys on every run of the benchmark

	// The store's scripts and arguments, as it sends them.
	hooked := redistest.Client(b)
	hook := &capture{}
	hooked.AddHook(hook)
	spy, err := redis.New(ctx, hooked, redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}
	if err := first(ctx, spy, key("spy", 0)); err != nil {
		b.Fatal(err)
	}
	if len(hook.evalsha) != 2 {
		b.Fatalf("a first call sent %d EVALSHA, want 2 (Reserve, Complete)", len(hook.evalsha))
	}
	// evalsha, sha, 3, record, marker, counter, offset, epoch, seen, ...
	reserveArgs, completeArgs := hook.evalsha[0], hook.evalsha[1]
	if len(reserveArgs) != 12 || len(completeArgs) != 11 {
		b.Fatalf("the store's EVALSHA: %v, %v", reserveArgs[:6], completeArgs[:6])
	}
	reserveSHA, completeSHA := reserveArgs[1].(string), completeArgs[1].(string)
	marker, counter := reserveArgs[4].(string), reserveArgs[5].(string)
	offset, epoch, seen := reserveArgs[6].(string), reserveArgs[7].(string), reserveArgs[8].(int64)
	fp := store.Fingerprint{1}
	lease, retention := reserveArgs[10].(int64), reserveArgs[11].(int64)

	// go-redis, as the store calls it: a new key's name, and the KEYS and
	// ARGV of each script, made per call.
	viaGoredis := func(c goredis.Scripter) (firstCall, replayCall func(context.Context, int) error) {
		reserve := func(ctx context.Context, record string) ([]any, error) {
			v, err := c.EvalSha(ctx, reserveSHA, []string{record, marker, counter}, offset, epoch, seen, fp[:], lease, retention).Result()
			a, _ := v.([]any)
			if err == nil && len(a) != 7 {
				err = fmt.Errorf("reserve: %v", v)
			}
			return a, err
		}
		firstCall = func(ctx context.Context, i int) error {
			record := name(key("f"+run, i))
			a, err := reserve(ctx, record)
			if err != nil {
				return err
			}
			if a[0] != int64(1) {
				return fmt.Errorf("reserve of a new key: %v", a)
			}
			token, _ := a[1].(int64)
			v, err := c.EvalSha(ctx, completeSHA, []string{record, marker, counter}, offset, epoch, seen, strconv.FormatInt(token, 10), outcome).Result()
			if a, _ := v.([]any); err == nil && (len(a) != 2 || a[0] != int64(1)) {
				err = fmt.Errorf("complete: %v", v)
			}
			return err
		}
		replayCall = func(ctx context.Context, i int) error {
			a, err := reserve(ctx, replays[i%len(replays)])
			if err == nil && a[0] != int64(2) {
				err = fmt.Errorf("reserve of a recorded key: %v", a)
			}
			return err
		}
		return firstCall, replayCall
	}
	goredisClient := func(b *testing.B, opts *goredis.Options) *goredis.Client {
		o := *client.Options()
		o.MaintNotificationsConfig = redistest.NoMaintNotifications()
		if opts != nil {
			o.PoolSize, o.MinIdleConns, o.AutoPipelineOptions = opts.PoolSize, opts.MinIdleConns, opts.AutoPipelineOptions
		}
		c := goredis.NewClient(&o)
		b.Cleanup(func() { c.Close() })
		return c
	}
	autoPipeliner := func(b *testing.B, fullDuplex bool) *goredis.AutoPipeliner {
		opts := goredis.DefaultBlockingAutoPipelineOptions()
		opts.FullDuplex = fullDuplex
		ap, err := goredisClient(b, nil).AutoPipelineWithOptions(opts)
		if err != nil {
			b.Fatal(err)
		}
		return ap
	}

	// valkey-go: its command builder, the arguments as strings.
	vk, err := valkey.NewClient(valkey.ClientOption{InitAddress: []string{client.Options().Addr}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(vk.Close)
	seenArg, leaseArg, retentionArg := strconv.FormatInt(seen, 10), strconv.FormatInt(lease, 10), strconv.FormatInt(retention, 10)
	fpArg, outcomeArg := valkey.BinaryString(fp[:]), valkey.BinaryString(outcome)
	vkReserve := func(ctx context.Context, record string) ([]valkey.ValkeyMessage, error) {
		a, err := vk.Do(ctx, vk.B().Evalsha().Sha1(reserveSHA).Numkeys(3).Key(record, marker, counter).
			Arg(offset, epoch, seenArg, fpArg, leaseArg, retentionArg).Build()).ToArray()
		if err == nil && len(a) != 7 {
			err = fmt.Errorf("reserve: %v", a)
		}
		return a, err
	}
	valkeyFirst := func(ctx context.Context, i int) error {
		record := name(key("f"+run, i))
		a, err := vkReserve(ctx, record)
		if err != nil {
			return err
		}
		if kind, _ := a[0].AsInt64(); kind != 1 {
			return fmt.Errorf("reserve of a new key: %v", a)
		}
		token, _ := a[1].AsInt64()
		r, err := vk.Do(ctx, vk.B().Evalsha().Sha1(completeSHA).Numkeys(3).Key(record, marker, counter).
			Arg(offset, epoch, seenArg, strconv.FormatInt(token, 10), outcomeArg).Build()).ToArray()
		if err == nil && len(r) != 2 {
			err = fmt.Errorf("complete: %v", r)
		}
		if err == nil {
			if ok, _ := r[0].AsInt64(); ok != 1 {
				err = fmt.Errorf("complete: %v", r)
			}
		}
		return err
	}
	valkeyReplay := func(ctx context.Context, i int) error {
		a, err := vkReserve(ctx, replays[i%len(replays)])
		if err == nil {
			if kind, _ := a[0].AsInt64(); kind != 2 {
				err = fmt.Errorf("reserve of a recorded key: %v", a)
			}
		}
		return err
	}

	// The store itself, on clients of its own.
	own, err := redis.New(ctx, redistest.Client(b), redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}
	ctxOpts := *client.Options()
	ctxOpts.MaintNotificationsConfig, ctxOpts.ContextTimeoutEnabled = redistest.NoMaintNotifications(), true
	ctxClient := goredis.NewClient(&ctxOpts)
	b.Cleanup(func() { ctxClient.Close() })
	ownCtx, err := redis.New(ctx, ctxClient, redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}

	clients := func(b *testing.B) []pipeClient {
		var cs []pipeClient
		add := func(name string, f, r func(context.Context, int) error) {
			cs = append(cs, pipeClient{name, f, r})
		}
		f, r := viaGoredis(goredisClient(b, nil))
		add("goredis", f, r)
		f, r = viaGoredis(goredisClient(b, &goredis.Options{PoolSize: 128, MinIdleConns: 64}))
		add("goredis-pool", f, r)
		f, r = viaGoredis(autoPipeliner(b, false))
		add("goredis-auto", f, r)
		f, r = viaGoredis(autoPipeliner(b, true))
		add("goredis-fd", f, r)
		add("valkey", valkeyFirst, valkeyReplay)
		add("store",
			func(ctx context.Context, i int) error { return first(ctx, own, key("f"+run, i)) },
			func(ctx context.Context, i int) error { return replay(ctx, own, key("r", i%len(replays))) })
		add("store-ctx",
			func(ctx context.Context, i int) error { return first(ctx, ownCtx, key("f"+run, i)) },
			func(ctx context.Context, i int) error { return replay(ctx, ownCtx, key("r", i%len(replays))) })
		return cs
	}

	var made atomic.Int64 // the last new key's number
	var gs []int
	for f := range strings.SplitSeq(*pipeliningGoroutines, ",") {
		g, err := strconv.Atoi(f)
		if err != nil || g < 1 {
			b.Fatalf("-pipelining-goroutines=%s", *pipeliningGoroutines)
		}
		gs = append(gs, g)
	}
	for _, op := range []string{"first", "replay"} {
		for _, g := range gs {
			b.Run(fmt.Sprintf("%s/g%d", op, g), func(b *testing.B) {
				cs := clients(b)
				chunk := 500 * min(g, 8) // calls per client per round
				call := func(c pipeClient) func(context.Context, int) error {
					if op == "first" {
						return c.first
					}
					return c.replay
				}
				totals := make([]pipeTotals, len(cs))
				for _, c := range cs { // warm up: dial the connections
					if _, err := pipeChunk(ctx, g, 4*g, call(c), &made); err != nil {
						b.Fatalf("%s: %v", c.name, err)
					}
				}
				n := 0
				for b.Loop() {
					for j := range cs {
						k := (n + j) % len(cs)
						t, err := pipeChunk(ctx, g, chunk, call(cs[k]), &made)
						if err != nil {
							b.Fatalf("%s: %v", cs[k].name, err)
						}
						totals[k].add(t)
					}
					n++
				}
				base := totals[0]
				for i, c := range cs {
					t := totals[i]
					b.ReportMetric(t.rate(), c.name+"-calls/s")
					b.ReportMetric(t.cpuPerCall(), c.name+"-cpu-µs")
					b.ReportMetric(t.allocsPerCall(), c.name+"-allocs")
					b.ReportMetric(t.p50(), c.name+"-p50-µs")
					if i == 0 {
						continue
					}
					b.ReportMetric(t.rate()/base.rate(), c.name+"-calls/"+cs[0].name)
					b.ReportMetric(t.cpuPerCall()/base.cpuPerCall(), c.name+"-cpu/"+cs[0].name)
					b.ReportMetric(t.allocsPerCall()/base.allocsPerCall(), c.name+"-allocs/"+cs[0].name)
					b.ReportMetric(t.p50()/base.p50(), c.name+"-p50/"+cs[0].name)
				}
			})
		}
	}
}

// pipeTotals adds up a client's chunks.
type pipeTotals struct {
	calls     int
	wall, cpu time.Duration
	allocs    uint64
	latencies []time.Duration
}

func (t *pipeTotals) add(o pipeTotals) {
	t.calls += o.calls
	t.wall += o.wall
	t.cpu += o.cpu
	t.allocs += o.allocs
	t.latencies = append(t.latencies, o.latencies...)
}

func (t *pipeTotals) rate() float64          { return float64(t.calls) / t.wall.Seconds() }
func (t *pipeTotals) cpuPerCall() float64    { return float64(t.cpu.Microseconds()) / float64(t.calls) }
func (t *pipeTotals) allocsPerCall() float64 { return float64(t.allocs) / float64(t.calls) }

func (t *pipeTotals) p50() float64 {
	slices.Sort(t.latencies)
	return float64(t.latencies[len(t.latencies)/2].Nanoseconds()) / 1e3
}

// pipeChunk makes calls calls of call from g goroutines, numbered from
// made's value on, and returns their wall time, this process's CPU time and
// heap allocations meanwhile, and each call's latency.
func pipeChunk(ctx context.Context, g, calls int, call func(context.Context, int) error, made *atomic.Int64) (pipeTotals, error) {
	var (
		next     atomic.Int64
		firstErr error
		errOnce  sync.Once
		wg       sync.WaitGroup
	)
	latencies := make([][]time.Duration, g)
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:objects"}}
	metrics.Read(sample)
	allocsBefore := sample[0].Value.Uint64()
	cpuBefore := processCPU()
	start := time.Now()
	for w := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, calls/g+1)
			for {
				if next.Add(1) > int64(calls) {
					break
				}
				i := int(made.Add(1))
				t := time.Now()
				if err := call(ctx, i); err != nil {
					errOnce.Do(func() { firstErr = err })
					break
				}
				lat = append(lat, time.Since(t))
			}
			latencies[w] = lat
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	cpu := processCPU() - cpuBefore
	metrics.Read(sample)
	t := pipeTotals{calls: calls, wall: wall, cpu: cpu, allocs: sample[0].Value.Uint64() - allocsBefore}
	for _, l := range latencies {
		t.latencies = append(t.latencies, l...)
	}
	return t, firstErr
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// pipelined is a go-redis hook that counts the EVALSHAs sent in pipelines.
type pipelined struct{ n atomic.Int64 }

func (h *pipelined) DialHook(next goredis.DialHook) goredis.DialHook          { return next }
func (h *pipelined) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook { return next }

func (h *pipelined) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []goredis.Cmder) error {
		for _, cmd := range cmds {
			if cmd.Name() == "evalsha" {
				h.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// Concurrent calls share writes (store/redis pipe.go): 32 goroutines' first
// calls and replays, on one server and on a cluster, each acquire a new key
// once and then replay its outcome; some scripts went in pipelines, and
// none on a client with ContextTimeoutEnabled.
func TestConcurrentCalls(t *testing.T) {
	server := redistest.Client(t)
	ctxOpts := *server.Options()
	ctxOpts.ContextTimeoutEnabled = true
	ctxClient := goredis.NewClient(&ctxOpts)
	t.Cleanup(func() { ctxClient.Close() })
	for _, tc := range []struct {
		name      string
		client    goredis.UniversalClient
		pipelines bool
	}{
		{"server", server, true},
		{"context-timeouts", ctxClient, false},
		{"cluster", redistest.SharedCluster(t).Client(t), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hook := &pipelined{}
			tc.client.AddHook(hook)
			ctx := t.Context()
			st, err := redis.New(ctx, tc.client, redis.WithPrefix(prefix()))
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			errs := make(chan error, 32)
			for g := range 32 {
				wg.Go(func() {
					for i := range 20 {
						key := store.ScopeKey("t", "/m", fmt.Sprint(g, "-", i))
						if err := first(ctx, st, key); err != nil {
							errs <- err
							return
						}
						res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour})
						if err == nil && (res.State != store.Completed || string(res.Outcome) != string(outcome)) {
							err = fmt.Errorf("replay: %v, %d bytes", res.State, len(res.Outcome))
						}
						if err != nil {
							errs <- err
							return
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if n := hook.n.Load(); (n > 0) != tc.pipelines {
				t.Errorf("%d scripts went in pipelines; want some: %v", n, tc.pipelines)
			}
		})
	}
}
