package idemtest_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/store/memory"
)

// A Kit in a test of an HTTP service behind idemhttp's middleware: through
// the Kit's RoundTripper, each call's first reply is dropped and sent again
// with its key, and two duplicates go at once beside it. Every attempt must
// get the same answer, one of them run and the others replayed, and the
// call must charge once; otherwise the Kit fails the test, naming the
// mistake and listing the attempts.
func ExampleNew() {
	// In a test, t is the test's *testing.T; the example makes its own.
	t := &testing.T{}

	var charges atomic.Int32 // the effect under test: a row, a provider's call
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		n := charges.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, n)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	kit := idemtest.New(t, idemtest.Chaos{
		DropReply:  true, // the first reply is lost: the retry with its key must get it, replayed
		Duplicates: 2,    // two more attempts at once, with the same key
		Effects: func(context.Context) (int, error) {
			return int(charges.Load()), nil
		},
	})
	client := &http.Client{Transport: kit.RoundTripper(srv.Client().Transport)}

	req, _ := http.NewRequest("POST", srv.URL+"/v1/charges", strings.NewReader(`{"amount":1999}`))
	req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
	resp, err := client.Do(req)
	if err != nil {
		panic(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(resp.StatusCode, string(body))
	fmt.Println("charges:", charges.Load(), "test failed:", t.Failed())
	// Output:
	// 201 {"id":"ch_1"}
	// charges: 1 test failed: false
}
