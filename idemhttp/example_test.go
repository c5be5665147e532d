package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store/memory"
)

// callerKey is where the application's authentication puts the caller.
type callerKey struct{}

// signedIn stands for the application's authentication middleware, which
// would check the request's credentials: every caller here is "acme".
func signedIn(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, "acme")))
	})
}

// tenantOf is the engine's TenantFunc: the caller the authentication found.
func tenantOf(ctx context.Context) (string, error) {
	caller, ok := ctx.Value(callerKey{}).(string)
	if !ok {
		return "", errors.New("not signed in")
	}
	return caller, nil
}

// A route whose first response to a key is recorded, and a retry with the
// same key that gets it back without the handler running; the same key with
// another body is refused.
func ExampleMiddleware() {
	var runs atomic.Int32
	createCharge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"ch_1"}`)
	})

	eng, err := engine.New(memory.New(), engine.WithTenant(tenantOf), engine.WithKeyRequired())
	if err != nil {
		panic(err)
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(createCharge)) // inside the route: r.Pattern names the operation
	srv := httptest.NewServer(signedIn(mux))
	defer srv.Close()

	post := func(body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/charges", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		fmt.Println(resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(raw))
	}
	post(`{"amount":1999}`)
	post(`{"amount":1999}`)
	post(`{"amount":2000}`)
	fmt.Println("handler runs:", runs.Load())
	// Output:
	// 201 false {"id":"ch_1"}
	// 201 true {"id":"ch_1"}
	// 422  {"type":"https://idemkey.dev/problems/idempotency-key-reused","title":"Idempotency-Key is already used with another request","status":422,"detail":"this Idempotency-Key was first used with another request"}
	// handler runs: 1
}
