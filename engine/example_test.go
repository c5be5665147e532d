package engine_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store/memory"
)

// One engine on a store, with the settings every entry point shares, handed
// to an entry point (here the net/http middleware; the gRPC interceptor, the
// Connect interceptor and message consumers take the same engine). Its hooks
// see each call's verdict: the first call executes and is recorded, its
// retry with the same key is replayed.
func ExampleNew() {
	eng, err := engine.New(memory.New(),
		engine.WithSingleTenant(), // every caller shares one key space: an internal API
		engine.WithKeyRequired(),
		engine.WithRetention(time.Hour),
		engine.WithHooks(engine.Hooks{
			OnExecute: func(_ context.Context, ev engine.Event) {
				fmt.Println("hook:", ev.Operation, ev.Verdict, ev.Code, "recorded:", ev.Recorded)
			},
			OnReplay: func(_ context.Context, ev engine.Event) {
				fmt.Println("hook:", ev.Operation, ev.Verdict, ev.Code)
			},
		}))
	if err != nil {
		panic(err)
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"ch_1"}`)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 { // a call, and its retry with the same key
		req, _ := http.NewRequest("POST", srv.URL+"/v1/charges", strings.NewReader(`{"amount":1999}`))
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body))
	}
	// Output:
	// hook: POST /v1/charges executed 201 recorded: true
	// 201 {"id":"ch_1"}
	// hook: POST /v1/charges replayed 201
	// 201 {"id":"ch_1"}
}

// New checks the options once, and its error names the fix.
func ExampleNew_mistake() {
	_, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithRetention(time.Minute))
	fmt.Println(err)
	// Output:
	// idemkey: the retention (1m0s, WithRetention) is shorter than the longest lease (10m0s, WithMaxLease): a record would expire while its call may still run; lengthen the retention or shorten the maximum lease
}
