package idemhttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/benchtest"
)

// BenchmarkHTTPParallel serves BenchmarkHTTPOverhead's POST from 16
// goroutines at once, in process on one memory store: bare, first calls (a
// new key each) and replays of 1,024 recorded keys. Besides time and
// -benchmem's allocations it reports the calls per second, the process's
// CPU per call and, with -mutexprofile, the share of the goroutines' time
// spent waiting for the store's locks (benchtest.Parallel).
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
			req := httptest.NewRequest(http.MethodPost, "/v1/charges", nil)
			req.Header.Set("Content-Type", "application/json")
			client := func() func(key string) {
				req, w := *req, writer{h: http.Header{}}
				req.Header = req.Header.Clone()
				return func(key string) {
					req.Header.Set(idemkey.KeyHeader, key)
					r := req
					r.Body = io.NopCloser(strings.NewReader(body))
					clear(w.h)
					w.code = 0
					h.ServeHTTP(&w, &r)
					if w.code != http.StatusCreated {
						b.Errorf("status %d", w.code)
					}
				}
			}
			call := client()
			for _, k := range names { // recorded before the clock starts
				call(k)
			}
			benchtest.Parallel(b, goroutines, "store/memory.", func(g int) func() {
				call, i := client(), g*keys/goroutines // each starts at its own key
				return func() {
					call(v.key(i))
					i++
				}
			})
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
