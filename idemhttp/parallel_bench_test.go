package idemhttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
)

// BenchmarkHTTPParallel serves BenchmarkHTTPOverhead's POST from 16
// goroutines at once, in process on one memory store: bare, first calls (a
// new key each) and replays of 1,024 recorded keys. Besides time and
// -benchmem's allocations it reports the calls per second, the process's
// CPU per call and the share of the goroutines' time spent waiting for a
// sync.Mutex: what a lock on the hot path costs.
func BenchmarkHTTPParallel(b *testing.B) {
	const goroutines, keys = 16, 1024
	const body = `{"customer_id":"cus_0123456789","amount":1999,"currency":"usd","description":"a charge"}`
	names := make([]string, keys)
	for i := range names {
		names[i] = idemkey.FormatKey("replay-" + strconv.Itoa(i))
	}
	var fresh atomic.Int64
	for _, v := range []struct {
		name    string
		guarded bool
		key     func(i int) string
	}{
		{"bare", false, func(i int) string { return names[i%keys] }},
		{"first", true, func(int) string { return idemkey.FormatKey("first-" + strconv.FormatInt(fresh.Add(1), 10)) }},
		{"replay", true, func(i int) string { return names[i%keys] }},
	} {
		b.Run(v.name, func(b *testing.B) {
			h := benchMux(b, v.guarded)
			// Each goroutine's request and writer are made once and reset
			// for each call, so that the harness allocates little beside
			// what it measures: a copy of the request and its body.
			type client struct {
				req *http.Request
				w   writer
			}
			newClient := func() *client {
				req := httptest.NewRequest(http.MethodPost, "/v1/charges", nil)
				req.Header.Set("Content-Type", "application/json")
				return &client{req: req, w: writer{h: http.Header{}}}
			}
			call := func(c *client, key string) {
				c.req.Header.Set(idemkey.KeyHeader, key)
				r := *c.req
				r.Body = io.NopCloser(strings.NewReader(body))
				clear(c.w.h)
				c.w.code = 0
				h.ServeHTTP(&c.w, &r)
				if c.w.code != http.StatusCreated {
					b.Errorf("status %d", c.w.code)
				}
			}
			c := newClient()
			for _, k := range names { // recorded before the clock starts
				call(c, k)
			}
			var worker atomic.Int64
			b.SetParallelism((goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			cpu0, wait0, start := cpuTime(), mutexWait(), time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				c := newClient()
				i := int(worker.Add(1)) * keys / goroutines // each starts at its own key
				for pb.Next() {
					call(c, v.key(i))
					i++
				}
			})
			b.StopTimer()
			wall := time.Since(start)
			b.ReportMetric(float64(b.N)/wall.Seconds(), "calls/s")
			b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(100*(mutexWait()-wait0)/(goroutines*wall.Seconds()), "mutex-wait-%")
		})
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

// cpuTime is the process's CPU time so far, user and system, in nanoseconds.
func cpuTime() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// mutexWait is the seconds goroutines have spent blocked on a sync.Mutex or
// sync.RWMutex so far.
func mutexWait() float64 {
	s := []metrics.Sample{{Name: "/sync/mutex/wait/total:seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 {
		return 0
	}
	return s[0].Value.Float64()
}
