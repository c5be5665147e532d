package idemtest_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/tbtest"
)

// httpServer serves b.charge as POST /v1/charges behind idemhttp's
// middleware: 201 and the charge, or 412 for a declined card (recorded, as gRPC records FailedPrecondition).
func httpServer(t *testing.T, b *backend, m mistake) *httptest.Server {
	t.Helper()
	eng := grpctest.Must(engine.New(b.store, engine.WithSingleTenant(), engine.WithLogger(nil)))
	var opts []idemhttp.Option
	if b.atomic {
		opts = append(opts, idemhttp.WithAtomic())
	}
	mw := grpctest.Must(idemhttp.Middleware(eng, opts...))
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Customer string }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		id, err := b.charge(r.Context(), req.Customer, m, nil)
		if status.Code(err) == codes.Unavailable {
			http.Error(w, status.Convert(err).Message(), http.StatusServiceUnavailable)
			return
		}
		if err != nil {
			w.WriteHeader(http.StatusPreconditionFailed)
			w.Write([]byte(status.Convert(err).Message()))
			return
		}
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]string{"id": id})
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// postWithKey sends one request of a charge with key, and returns its
// status.
func postWithKey(ctx context.Context, client *http.Client, url, key, customer string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/charges", strings.NewReader(`{"customer": "`+customer+`"}`))
	if err != nil {
		return 0, err
	}
	req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(key))
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// postCharge is an HTTP client that retries a request that got no
// response, with the key it made once for the operation, or with a new key
// per attempt.
func postCharge(ctx context.Context, client *http.Client, url, customer string, keyPerAttempt bool) (int, error) {
	key := idemkey.NewKey()
	var err error
	for range 3 {
		if keyPerAttempt {
			key = idemkey.NewKey()
		}
		var req *http.Request
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/charges", strings.NewReader(`{"customer": "`+customer+`"}`))
		if err != nil {
			return 0, err
		}
		req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(key))
		var resp *http.Response
		resp, err = client.Do(req)
		if err == nil {
			resp.Body.Close()
			return resp.StatusCode, nil
		}
	}
	return 0, err
}

// Over HTTP the kit passes a correct handler and client on every store,
// and catches a key made per attempt and a side effect before a recorded
// error.
func TestHTTP(t *testing.T) {
	for _, kind := range backendKinds {
		t.Run(kind, func(t *testing.T) {
			b := openBackend(t, kind)
			r := tbtest.New(t)
			srv := httpServer(t, b, none)
			client := &http.Client{Transport: idemtest.New(r, allChaos(b)).RoundTripper(srv.Client().Transport)}
			if code, err := postCharge(t.Context(), client, srv.URL, "cus_1", false); code != http.StatusCreated {
				t.Errorf("charge: %d, %v; want 201", code, err)
			}
			if code, err := postCharge(t.Context(), client, srv.URL, declined, false); code != http.StatusPreconditionFailed {
				t.Errorf("declined charge: %d, %v; want 412", code, err)
			}
			tbtest.WantPass(t, r)

			r = tbtest.New(t)
			client = &http.Client{Transport: idemtest.New(r, idemtest.Chaos{LoseReply: true, Effects: b.effects}).RoundTripper(srv.Client().Transport)}
			postCharge(t.Context(), client, srv.URL, "cus_1", true)
			tbtest.WantFailure(t, r, "a key made per attempt", "once per operation", "Idempotency-Key header")

			r = tbtest.New(t)
			srv = httpServer(t, b, effectBeforeError)
			client = &http.Client{Transport: idemtest.New(r, idemtest.Chaos{Duplicates: 2, DropReply: true, Effects: b.effects}).RoundTripper(srv.Client().Transport)}
			postCharge(t.Context(), client, srv.URL, declined, false)
			if b.atomic {
				tbtest.WantPass(t, r)
				return
			}
			tbtest.WantFailure(t, r, "answered 412, yet left 1 effect(s): a side effect before an error")
		})
	}
}

// Against a server without idemkey, the kit reports that a retry ran the
// handler again and answered otherwise; a kit through which no request
// carried a key fails, since it checked nothing; and a lost reply that the
// caller never retries fails too.
func TestHTTPMisuse(t *testing.T) {
	b := openBackend(t, "memory")
	bare := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.effect(r.Context(), none)
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id": "ch_` + idemkey.NewKey() + `"}`))
	}))
	t.Cleanup(bare.Close)

	r := tbtest.New(t)
	client := &http.Client{Transport: idemtest.New(r, idemtest.Chaos{DropReply: true, Effects: b.effects}).RoundTripper(nil)}
	postCharge(t.Context(), client, bare.URL, "cus_1", false)
	tbtest.WantFailure(t, r, "attempt 2 got another reply than attempt 1 (both 201)", "2 attempts with one key got a reply not marked replayed", "one key, 2 effects")

	r = tbtest.New(t)
	client = &http.Client{Transport: idemtest.New(r, idemtest.Chaos{DropReply: true}).RoundTripper(nil)}
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, bare.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req) // no key
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	tbtest.WantFailure(t, r, "no call through the kit carried an idempotency key", "chain the kit after the client's key interceptor")

	r = tbtest.New(t)
	srv := httpServer(t, b, none)
	client = &http.Client{Transport: idemtest.New(r, idemtest.Chaos{LoseReply: true}).RoundTripper(srv.Client().Transport)}
	req, err = http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"customer": "cus_1"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(idemkey.NewKey()))
	if _, err := client.Do(req); err == nil {
		t.Error("the lost reply reached the caller")
	}
	tbtest.WantFailure(t, r, "the caller never retried the call whose reply was lost")
}
