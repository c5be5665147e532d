package example_test

// This file is docs/http.md's net/http snippet, between the markers; the
// page's copy must match it (TestREADMESnippets).

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store/memory"
)

// readme:http
// newHTTPHandler serves POST /v1/charges: the first response of each key is
// recorded, and every retry gets it back with Idempotent-Replayed: true.
// Serve it with http.ListenAndServe(addr, h).
func newHTTPHandler() (http.Handler, error) {
	eng, err := engine.New(memory.New(), // one per process, for every entry point
		engine.WithTenant(tenantOf), // reads the tenant back
		engine.WithKeyRequired())
	if err != nil {
		return nil, err // a mistake in the options
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(http.HandlerFunc(createCharge))) // the pattern scopes the key
	return authenticate(mux), nil
}

func createCharge(w http.ResponseWriter, r *http.Request) { // your handler
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	json.NewEncoder(w).Encode(map[string]string{"id": "ch_" + idemkey.NewKey()})
}

type tenantKey struct{}

// authenticate stands in for your authentication: "Bearer <tenant>".
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok {
			http.Error(w, "unauthenticated", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), tenantKey{}, tenant)))
	})
}

func tenantOf(ctx context.Context) (string, error) {
	tenant, ok := ctx.Value(tenantKey{}).(string)
	if !ok {
		return "", errors.New("no tenant")
	}
	return tenant, nil
}

// end readme

// The README's HTTP handler charges once per key: a retry gets the recorded
// response, marked as a replay, and the same key with another body is 422.
func TestREADMEHTTP(t *testing.T) {
	h, err := newHTTPHandler()
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	// post sends the key's value as it is: a client's is
	// idemkey.FormatKey(key), the RFC 8941 string.
	post := func(key, body string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer acme")
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set(idemkey.KeyHeader, key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}

	const body = `{"amount": 1999, "currency": "EUR"}`
	key := idemkey.FormatKey("order-1")
	first, firstBody := post(key, body)
	if first.StatusCode != http.StatusCreated || first.Header.Get(idemkey.ReplayedHeader) != "false" {
		t.Fatalf("first request: %s, %s: %q; want 201, false: the first execution", first.Status, idemkey.ReplayedHeader, first.Header.Get(idemkey.ReplayedHeader))
	}
	// A retry that sends the key bare, as Stripe's clients do, names the
	// same key: the server is lenient.
	for _, v := range []string{key, "order-1"} {
		retry, retryBody := post(v, body)
		if retry.StatusCode != http.StatusCreated || retry.Header.Get(idemkey.ReplayedHeader) != "true" || retryBody != firstBody {
			t.Errorf("retry with %s: %s, %s: %q, body %q; want 201, true, %q", v, retry.Status, idemkey.ReplayedHeader, retry.Header.Get(idemkey.ReplayedHeader), retryBody, firstBody)
		}
	}
	if reused, _ := post(key, `{"amount": 2500, "currency": "EUR"}`); reused.StatusCode != http.StatusUnprocessableEntity {
		t.Errorf("the key with another body: %s, want 422", reused.Status)
	}
	if missing, _ := post("", body); missing.StatusCode != http.StatusBadRequest {
		t.Errorf("no key: %s, want 400", missing.Status)
	}
}
