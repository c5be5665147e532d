//go:build unix

package memory_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkVsLocked calls this store and the store before its shards
// (memory.NewLocked) from 16 goroutines at once, interleaved in one
// process: first calls (a new key each) and replays of 1,024 recorded keys,
// through idemhttp (http: a POST, as idemhttp's BenchmarkHTTPParallel) and
// on the store alone (store: BenchmarkParallel's calls); the -serial ones
// from one goroutine, for the CPU of an uncontended call. It reports each
// one's calls per second, CPU and allocations per call and, with
// -mutexprofile, the share of goroutine time waiting for the store's locks,
// and the ratios of this store to the old.
func BenchmarkVsLocked(b *testing.B) {
	b.Run("http", func(b *testing.B) { vsLocked(b, 16, 64, viaHTTP) })
	b.Run("http-serial", func(b *testing.B) { vsLocked(b, 1, 512, viaHTTP) })
	b.Run("store", func(b *testing.B) { vsLocked(b, 16, 1024, direct) })
	b.Run("store-serial", func(b *testing.B) { vsLocked(b, 1, 4096, direct) })
}

// A caller returns goroutine g's call of st (first calls or replays), and
// records the keys of replays before the clock starts.
type caller func(b *testing.B, st store.Store, replay bool) func(g int) func(i int) error

// vsLocked runs newCall's first calls and replays on both stores from
// goroutines goroutines, chunk calls of each at a time.
func vsLocked(b *testing.B, goroutines, chunk int, newCall caller) {
	roomy := []memory.Option{memory.WithMaxRecords(1 << 30), memory.WithMaxBytes(1 << 40)}
	var ops []benchtest.ParallelOp
	for _, replay := range []bool{false, true} {
		for _, s := range []struct {
			name, within string
			st           store.Store
		}{
			{"locked", "memory.(*lockedStore)", memory.NewLocked(roomy...)},
			{"sharded", "memory.(*Store)", memory.New(roomy...)},
		} {
			kind := map[bool]string{false: "first", true: "replay"}[replay]
			ops = append(ops, benchtest.ParallelOp{Name: kind + "-" + s.name, Within: s.within, New: newCall(b, s.st, replay)})
		}
	}
	stats := benchtest.InterleaveParallel(b, goroutines, chunk, ops...)
	for i := 0; i < len(stats); i += 2 {
		kind := strings.TrimSuffix(ops[i].Name, "-locked")
		b.ReportMetric(stats[i+1].CallsPerSecond/stats[i].CallsPerSecond, kind+"-calls/s-sharded/locked")
		b.ReportMetric(float64(stats[i+1].CPUPerCall)/float64(stats[i].CPUPerCall), kind+"-cpu-sharded/locked")
	}
}

const replayKeys = 1024

// viaHTTP calls st through idemhttp.
func viaHTTP(b *testing.B, st store.Store, replay bool) func(g int) func(i int) error {
	names := make([]string, replayKeys)
	for i := range names {
		names[i] = idemkey.FormatKey("replay-" + strconv.Itoa(i))
	}
	h := guarded(b, st)
	key := func(g, i int) string { return names[(g*replayKeys/16+i)%replayKeys] }
	if !replay {
		key = func(g, i int) string { return idemkey.FormatKey(fmt.Sprintf("first-%d-%d", g, i)) }
	}
	call := client(h)
	for _, k := range names { // recorded before the clock starts
		if err := call(k); err != nil {
			b.Fatal(err)
		}
	}
	return func(g int) func(int) error {
		call := client(h)
		return func(i int) error { return call(key(g, i)) }
	}
}

// direct calls st as the engine does: Reserve, then Complete of a new key.
func direct(b *testing.B, st store.Store, replay bool) func(g int) func(i int) error {
	ctx := context.Background()
	outcome := make([]byte, 200)
	reservation := func(key string) store.Reservation {
		return store.Reservation{Key: store.ScopeKey("t", "/m", key), Lease: time.Minute,
			Retention: time.Hour, MaxOutcome: 4 << 10, Partition: store.TenantPartition("t")}
	}
	recorded := make([]store.Reservation, replayKeys)
	for i := range recorded {
		recorded[i] = reservation("replay-" + strconv.Itoa(i))
		res, err := st.Reserve(ctx, recorded[i])
		if err == nil {
			err = st.Complete(ctx, recorded[i].Key, res.Token, outcome)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	return func(g int) func(int) error {
		if replay {
			return func(i int) error {
				res, err := st.Reserve(ctx, recorded[(g*replayKeys/16+i)%replayKeys])
				if err == nil && res.State != store.Completed {
					err = fmt.Errorf("replay: %v", res.State)
				}
				return err
			}
		}
		return func(i int) error {
			r := reservation(fmt.Sprintf("first-%d-%d", g, i))
			res, err := st.Reserve(ctx, r)
			if err != nil {
				return err
			}
			return st.Complete(ctx, r.Key, res.Token, outcome)
		}
	}
}

// guarded is a ServeMux with a create route behind idemhttp on st.
func guarded(b *testing.B, st store.Store) http.Handler {
	b.Helper()
	create := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, "unreadable", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/charges/ch_0123456789abcdef01234567")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ch_0123456789abcdef01234567","customer_id":"cus_0123456789","amount":1999,"currency":"usd","description":"a charge"}`)
	})
	eng, err := engine.New(st, engine.WithTenant(func(ctx context.Context) (string, error) { return "tenant-1", nil }))
	if err != nil {
		b.Fatal(err)
	}
	mw, err := idemhttp.Middleware(eng)
	if err != nil {
		b.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw(create))
	return mux
}

// client returns a call of h with one request and writer, reset for each
// call, so that the harness allocates little beside what it measures.
func client(h http.Handler) func(key string) error {
	const body = `{"customer_id":"cus_0123456789","amount":1999,"currency":"usd","description":"a charge"}`
	req := httptest.NewRequest(http.MethodPost, "/v1/charges", nil)
	req.Header.Set("Content-Type", "application/json")
	w := &writer{h: http.Header{}}
	return func(key string) error {
		req.Header.Set(idemkey.KeyHeader, key)
		r := *req
		r.Body = io.NopCloser(strings.NewReader(body))
		clear(w.h)
		w.code = 0
		h.ServeHTTP(w, &r)
		if w.code != http.StatusCreated {
			return fmt.Errorf("status %d", w.code)
		}
		return nil
	}
}

// writer is a ResponseWriter that keeps the status and drops the body.
type writer struct {
	h    http.Header
	code int
}

func (w *writer) Header() http.Header { return w.h }
func (w *writer) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}
func (w *writer) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return len(p), nil
}
