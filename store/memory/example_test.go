package memory_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store/memory"
)

// chargeRoute serves POST /v1/charges behind idemhttp's middleware on eng,
// counting the handler's runs.
func chargeRoute(eng *engine.Engine, runs *int) http.Handler {
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		*runs++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, *runs)
	})))
	return mux
}

// post sends one charge with key to h, and prints the answer.
func post(h http.Handler, key string) {
	req := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(`{"amount":1999}`))
	req.Header.Set("Idempotency-Key", `"`+key+`"`)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println(key, rec.Code, rec.Header().Get("Idempotent-Replayed"), rec.Body.String())
}

// A single-process service keeps its keys in memory, within bounds: a new
// key the store has no room for is refused before its handler runs (503,
// the store is full), while the keys it holds still replay.
func ExampleNew() {
	st := memory.New(memory.WithMaxRecords(2)) // the defaults: 100,000 records, 64 MiB
	eng, err := engine.New(st, engine.WithSingleTenant(), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	runs := 0
	h := chargeRoute(eng, &runs)

	post(h, "key-1")
	post(h, "key-2")
	post(h, "key-3") // no room: refused
	post(h, "key-1") // a retry: replayed
	fmt.Println("records:", st.Len(), "runs:", runs)
	// Output:
	// key-1 201 false {"id":"ch_1"}
	// key-2 201 false {"id":"ch_2"}
	// key-3 503  {"type":"https://idemkey.dev/problems/idempotency-store-full","title":"The idempotency store is full","status":503,"detail":"the idempotency store has no room for a new key; retry later"}
	// key-1 201 true {"id":"ch_1"}
	// records: 2 runs: 2
}

// A test moves the store's clock instead of sleeping: once the retention
// has passed, a key is new again and its handler runs again.
func ExampleWithClock() {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	st := memory.New(memory.WithClock(func() time.Time { return now }))
	eng, err := engine.New(st, engine.WithSingleTenant(), engine.WithRetention(time.Hour))
	if err != nil {
		panic(err)
	}
	runs := 0
	h := chargeRoute(eng, &runs)

	post(h, "key-1")
	now = now.Add(59 * time.Minute)
	post(h, "key-1") // within the retention: replayed
	now = now.Add(2 * time.Minute)
	post(h, "key-1") // after it: the key is new again
	// Output:
	// key-1 201 false {"id":"ch_1"}
	// key-1 201 true {"id":"ch_1"}
	// key-1 201 false {"id":"ch_2"}
}
