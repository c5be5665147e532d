package redis_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// capture is a go-redis hook that keeps the arguments of every EVALSHA
// sent through its client.
type capture struct{ evalsha [][]any }

func (c *capture) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (c *capture) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		if cmd.Name() == "evalsha" {
			c.evalsha = append(c.evalsha, append([]any(nil), cmd.Args()...))
		}
		return next(ctx, cmd)
	}
}

func (c *capture) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return next
}

// BenchmarkFloor measures the least a store on go-redis could spend on the
// store's own server work, and what the store adds to it. It interleaves,
// on one server, the store's first call (Reserve and Complete) and replay
// with the same scripts sent by hand (direct): EVALSHA of the store's own
// scripts (their SHAs and arguments read from what the store sent, through
// a hook), with every name and argument made before the call, so that
// only go-redis's path and the server's work are timed. Beside them: the
// replay's EVALSHA through Do with its whole command made beforehand (no
// argument slice, no boxing), the same on a RESP2 client, a bare PING,
// and TIME and HMGET of the record in one pipeline (what a replay without
// Lua would send; not the store's answer on a cluster or near an expiry,
// only the floor of a read).
//
// It reports each store call's time as a ratio to its direct one
// ("first/direct-first", "replay/direct-replay") and the allocations it
// adds ("first-added-allocs"), and, each run on its own, every op's CPU in
// this process ("-cpu-µs") and in the server ("-server-µs"): on a machine
// shared with other work the CPU per call moves less than the time.
func BenchmarkFloor(b *testing.B) {
	ctx := context.Background()
	client := redistest.Client(b)
	p := prefix()
	st, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		b.Fatal(err)
	}
	key := func(kind string, i int) store.Key { return store.ScopeKey("bench", kind, strconv.Itoa(i)) }
	for i := range 1000 { // for the replays
		if err := first(ctx, st, key("r", i)); err != nil {
			b.Fatal(err)
		}
	}

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
	reserveArgs, completeArgs := hook.evalsha[0], hook.evalsha[1]
	// evalsha, sha, 3, record, marker, counter, offset, epoch, seen, ...
	if len(reserveArgs) != 12 || len(completeArgs) != 11 || reserveArgs[2] != 3 {
		b.Fatalf("the store's EVALSHA: %v, %v", reserveArgs[:6], completeArgs[:6])
	}
	reserveSHA, completeSHA := reserveArgs[1].(string), completeArgs[1].(string)
	marker, counter := reserveArgs[4].(string), reserveArgs[5].(string)
	offset, epoch, seen := reserveArgs[6], reserveArgs[7], reserveArgs[8]
	fp, lease, retention := store.Fingerprint{1}, reserveArgs[10], reserveArgs[11]
	if lease != time.Minute.Microseconds() || retention != (24*time.Hour).Microseconds() {
		b.Fatalf("the store's Reserve sent lease %v, retention %v", lease, retention)
	}
	name := func(k store.Key) string { return p + ":{" + hex.EncodeToString(k[:]) + "}" }

	// direct: the store's Reserve and Complete scripts with the same
	// arguments, made before the call (in Before, untimed).
	var firstKeys []string
	directFirst := func(int) error {
		v, err := client.EvalSha(ctx, reserveSHA, firstKeys, offset, epoch, seen, fp[:], lease, retention).Result()
		if err != nil {
			return err
		}
		a, _ := v.([]any)
		if len(a) != 7 || a[0] != int64(1) {
			return fmt.Errorf("reserve of a new key: %v", v)
		}
		token, _ := a[1].(int64)
		v, err = client.EvalSha(ctx, completeSHA, firstKeys, offset, epoch, seen, strconv.FormatInt(token, 10), outcome).Result()
		if a, _ := v.([]any); err == nil && (len(a) != 2 || a[0] != int64(1)) {
			err = fmt.Errorf("complete: %v", v)
		}
		return err
	}
	run := prefix()
	newKeys := func(kind string) func(int) {
		return func(i int) { firstKeys = []string{name(key(kind+run, i)), marker, counter} }
	}
	replayKeys := make([][]string, 1000)
	replayCmds := make([][]any, 1000)
	for i := range replayKeys {
		replayKeys[i] = []string{name(key("r", i)), marker, counter}
		replayCmds[i] = []any{"evalsha", reserveSHA, 3, replayKeys[i][0], marker, counter, offset, epoch, seen, fp[:], lease, retention}
	}
	completed := func(v any, err error) error {
		if a, _ := v.([]any); err == nil && (len(a) != 7 || a[0] != int64(2)) {
			err = fmt.Errorf("reserve of a recorded key: %v", v)
		}
		return err
	}
	resp2Opts := *client.Options()
	resp2Opts.Protocol = 2
	resp2 := goredis.NewClient(&resp2Opts)
	b.Cleanup(func() { resp2.Close() })

	ops := []benchtest.Op{
		{Name: "ping", Run: func(int) error { return client.Ping(ctx).Err() }},
		{Name: "first", Run: func(i int) error { return first(ctx, st, key("f"+run, i)) }},
		{Name: "direct-first", Run: directFirst, Before: newKeys("d")},
		{Name: "replay", Run: func(i int) error { return replay(ctx, st, key("r", i%1000)) }},
		{Name: "direct-replay", Run: func(i int) error {
			return completed(client.EvalSha(ctx, reserveSHA, replayKeys[i%1000], offset, epoch, seen, fp[:], lease, retention).Result())
		}},
		{Name: "do-replay", Run: func(i int) error { return completed(client.Do(ctx, replayCmds[i%1000]...).Result()) }},
		{Name: "resp2-replay", Run: func(i int) error { return completed(resp2.Do(ctx, replayCmds[i%1000]...).Result()) }},
		{Name: "nolua-replay", Run: func(i int) error {
			var hm *goredis.SliceCmd
			_, err := client.Pipelined(ctx, func(pl goredis.Pipeliner) error {
				pl.Time(ctx)
				hm = pl.HMGet(ctx, replayKeys[i%1000][0], "s", "f", "o", "e")
				return nil
			})
			if err == nil && hm.Val()[0] != "c" {
				err = errors.New("a recorded key's HMGET has no completed record")
			}
			return err
		}},
	}
	ns := benchtest.Interleave(b, ops...)

	// Allocations and CPU, each op on its own, on keys of their own.
	later := func(runID string) []benchtest.Op {
		again := append([]benchtest.Op(nil), ops...)
		again[1].Run = func(i int) error { return first(ctx, st, key("f"+runID, i)) }
		again[2].Before = func(i int) { firstKeys = []string{name(key("d"+runID, i)), marker, counter} }
		return again
	}
	allocs := benchtest.Allocs(b, 200, later(prefix())...)
	for _, pair := range [][2]int{{1, 2}, {3, 4}, {4, 5}} {
		store, direct := ops[pair[0]].Name, ops[pair[1]].Name
		b.ReportMetric(ns[pair[0]]/ns[pair[1]], store+"/"+direct)
		b.ReportMetric(allocs[pair[0]]-allocs[pair[1]], store+"-over-"+direct+"-allocs")
	}
	b.ReportMetric(ns[4]/ns[0], "direct-replay/ping")
	b.ReportMetric(ns[7]/ns[0], "nolua-replay/ping")
	b.ReportMetric(ns[6]/ns[5], "resp2-replay/do-replay")
	for i, op := range later(prefix()) {
		b.ReportMetric(allocs[i], op.Name+"-allocs")
		if inner := op; op.Before != nil { // spent has no Before: its CPU is the direct call's, a slice more
			op.Run = func(i int) error { inner.Before(i); return inner.Run(i) }
		}
		server, cpu := spent(b, client, 2000, op)
		b.ReportMetric(server, op.Name+"-server-µs")
		b.ReportMetric(cpu, op.Name+"-cpu-µs")
	}
}
