package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkHTTPOverhead serves a POST in process (ServeHTTP, no network)
// three ways, interleaved so that a noisy machine slows all alike: a route
// without the middleware; a first call on the memory store (a new key each
// time); and a replay (one key, recorded once). The handler reads the body
// and answers a small JSON document, as a create handler does. It reports
// each one's time, its ratio to the bare call, and the time and the
// allocations (counted apart, see benchtest.Allocs) each adds to it.
func BenchmarkHTTPOverhead(b *testing.B) {
	bare, guarded := benchMux(b, false), benchMux(b, true)
	const body = `{"customer_id":"cus_0123456789","amount":1999,"currency":"usd","description":"a charge"}`
	// The request of each call, made before it is timed: a new key for
	// every first call, of Interleave's and Allocs' runs alike.
	var req *http.Request
	firsts := 0
	request := func(key string) {
		req = httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(key))
	}
	call := func(h http.Handler) error {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != http.StatusCreated {
			return fmt.Errorf("status %d: %s", w.Code, w.Body)
		}
		return nil
	}
	request("replay")
	if err := call(guarded); err != nil {
		b.Fatal(err)
	}
	ops := []benchtest.Op{
		{Name: "bare", Run: func(int) error { return call(bare) }, Before: func(int) { request("bare") }},
		{Name: "first", Run: func(int) error { return call(guarded) }, Before: func(int) { firsts++; request("first-" + strconv.Itoa(firsts)) }},
		{Name: "replay", Run: func(int) error { return call(guarded) }, Before: func(int) { request("replay") }},
	}
	ns := benchtest.Interleave(b, ops...)
	benchtest.ReportAdded(b, ops, ns, benchtest.Allocs(b, 1000, ops...))
}

// benchMux is a ServeMux with the benchmark's create route, behind the
// middleware on a memory store if guarded.
func benchMux(b *testing.B, guarded bool) http.Handler {
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
	mux := http.NewServeMux()
	if !guarded {
		mux.Handle("POST /v1/charges", create)
		return mux
	}
	// Room for every first call of a long run: the default bounds fill up
	// with the records of some 100,000 calls.
	st := memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40))
	eng, err := engine.New(st, engine.WithTenant(func(ctx context.Context) (string, error) { return "tenant-1", nil }))
	if err != nil {
		b.Fatal(err)
	}
	mw, err := idemhttp.Middleware(eng)
	if err != nil {
		b.Fatal(err)
	}
	mux.Handle("POST /v1/charges", mw(create))
	return mux
}
