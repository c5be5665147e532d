package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/enginetest"

	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/logtest"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// server is a real net/http server with the middleware, for one test.
type server struct {
	t    *testing.T
	url  string
	runs atomic.Int64
}

// newServer serves mux, built by routes with the middleware mw, behind the
// authentication middleware. The middleware has opts, on an engine on a
// memory store with engOpts, after the tenant of the authentication, no
// logger and no wait for a key in progress.
func newServer(t *testing.T, engOpts []engine.Option, opts []idemhttp.Option, routes func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux)) *server {
	t.Helper()
	engOpts = append([]engine.Option{engine.WithTenant(tenantFromContext), engine.WithLogger(nil), engine.WithInProgressWait(0)}, engOpts...)
	mw, err := idemhttp.Middleware(newEngine(t, memory.New(), engOpts...), opts...)
	if err != nil {
		t.Fatal(err)
	}
	s := &server{t: t}
	mux := http.NewServeMux()
	routes(s, mw, mux)
	srv := httptest.NewServer(authenticate(mux))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

// newEngine is the engine on st with opts.
func newEngine(t *testing.T, st store.Store, opts ...engine.Option) *engine.Engine {
	t.Helper()
	eng, err := engine.New(st, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return eng
}

// handler counts its runs, then runs f.
func (s *server) handler(f http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.runs.Add(1)
		f(w, r)
	})
}

// call is one request: method, path, key (the header's raw value; "" for
// none) and body.
func (s *server) call(method, path, key, body string) (*http.Response, []byte) {
	s.t.Helper()
	req, err := http.NewRequest(method, s.url+path, strings.NewReader(body))
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer acme")
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idemkey.KeyHeader, key)
	}
	return s.do(req)
}

func (s *server) do(req *http.Request) (*http.Response, []byte) {
	s.t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("read the body: %v", err)
	}
	return resp, raw
}

func (s *server) wantRuns(want int64) {
	s.t.Helper()
	if got := s.runs.Load(); got != want {
		s.t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// wantProblem checks that resp is the middleware's problem for reason.
func wantProblem(t *testing.T, resp *http.Response, raw []byte, status int, reason string) idemhttp.Problem {
	t.Helper()
	var p idemhttp.Problem
	if ct := resp.Header.Get("Content-Type"); ct != idemhttp.ProblemContentType {
		t.Fatalf("status %d, Content-Type %q, body %q; want a problem", resp.StatusCode, ct, raw)
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatalf("decode the problem %q: %v", raw, err)
	}
	if resp.StatusCode != status || p.Status != status || idemhttp.ProblemReason(p.Type) != reason || p.Title == "" {
		t.Fatalf("got %d %+v, want status %d with reason %q", resp.StatusCode, p, status, reason)
	}
	return p
}

func TestReplayIsByteIdentical(t *testing.T) {
	body := []byte("{\"id\": \"ch_1\",\n \"note\": \"\u00e9\"}\x00\xff")
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h.Set("Content-Type", "application/json; charset=utf-8")
			h.Set("Location", "/v1/charges/ch_1")
			h.Add("Content-Language", "en")
			h.Add("Content-Language", "fr")
			h.Set("Set-Cookie", "session=secret")
			h.Set("X-Request-Run", "first")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(body[:5])
			_, _ = w.Write(body[5:])
		})))
		mux.Handle("POST /v1/sniffed", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write([]byte("<html><body>hi</body></html>"))
		})))
	})

	first, firstBody := s.call("POST", "/v1/charges", `"k1"`, `{"amount":1}`)
	if first.StatusCode != http.StatusCreated || !bytes.Equal(firstBody, body) || first.Header.Get(idemkey.ReplayedHeader) != "false" {
		t.Fatalf("first: %d %q %v", first.StatusCode, firstBody, first.Header)
	}
	if first.Header.Get("Set-Cookie") == "" || first.Header.Get("X-Request-Run") == "" {
		t.Fatalf("the first caller lost the handler's other fields: %v", first.Header)
	}
	for _, key := range []string{`"k1"`, `k1`} { // the sf-string and the bare key are one key
		replay, replayBody := s.call("POST", "/v1/charges", key, `{"amount":1}`)
		if replay.StatusCode != first.StatusCode || !bytes.Equal(replayBody, firstBody) {
			t.Fatalf("replay: %d %q, want %d %q", replay.StatusCode, replayBody, first.StatusCode, firstBody)
		}
		if replay.Header.Get(idemkey.ReplayedHeader) != "true" {
			t.Fatalf("replay not marked: %v", replay.Header)
		}
		for _, k := range []string{"Content-Type", "Location", "Content-Language", "Content-Length"} {
			if got, want := replay.Header.Values(k), first.Header.Values(k); strings.Join(got, "|") != strings.Join(want, "|") {
				t.Errorf("replay %s = %q, want %q", k, got, want)
			}
		}
		for _, k := range []string{"Set-Cookie", "X-Request-Run"} {
			if v := replay.Header.Get(k); v != "" {
				t.Errorf("replay has %s: %q; only the replay list is replayed", k, v)
			}
		}
	}
	s.wantRuns(1)

	// A Content-Type that net/http would sniff is sniffed before the record.
	first, firstBody = s.call("POST", "/v1/sniffed", `"k1"`, `{}`)
	replay, replayBody := s.call("POST", "/v1/sniffed", `"k1"`, `{}`)
	if ct := first.Header.Get("Content-Type"); ct != "text/html; charset=utf-8" || replay.Header.Get("Content-Type") != ct || !bytes.Equal(firstBody, replayBody) {
		t.Fatalf("sniffed: first %q %q, replay %q %q", ct, firstBody, replay.Header.Get("Content-Type"), replayBody)
	}
}

// A covered response is sent when the handler returns, so its header is
// read then: a field set after WriteHeader, or after Write, reaches the
// first caller, and, if on the replay list, every retry. Without a key the
// handler writes to net/http itself, which sends the header at WriteHeader
// and drops such a field.
func TestHeaderSetAfterWriteHeader(t *testing.T) {
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			h := w.Header()
			h.Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			h.Set("Location", "/v1/charges/ch_1") // on the replay list
			h.Set("X-Late", "after WriteHeader")  // off it
			_, _ = io.WriteString(w, `{"id":"ch_1"}`)
			w.Header().Set("Content-Language", "en") // on it, after Write
		})))
	})

	first, firstBody := s.call("POST", "/v1/charges", `"k1"`, `{}`)
	if first.StatusCode != http.StatusCreated || first.Header.Get(idemkey.ReplayedHeader) != "false" {
		t.Fatalf("first: %d %v", first.StatusCode, first.Header)
	}
	for k, want := range map[string]string{"Location": "/v1/charges/ch_1", "X-Late": "after WriteHeader", "Content-Language": "en"} {
		if got := first.Header.Get(k); got != want {
			t.Errorf("the first caller's %s = %q, want %q, set after WriteHeader", k, got, want)
		}
	}
	replay, replayBody := s.call("POST", "/v1/charges", `"k1"`, `{}`)
	if replay.StatusCode != http.StatusCreated || replay.Header.Get(idemkey.ReplayedHeader) != "true" || !bytes.Equal(replayBody, firstBody) {
		t.Fatalf("replay: %d %q %v", replay.StatusCode, replayBody, replay.Header)
	}
	for k, want := range map[string]string{"Location": "/v1/charges/ch_1", "X-Late": "", "Content-Language": "en"} {
		if got := replay.Header.Get(k); got != want {
			t.Errorf("the replay's %s = %q, want %q: the replay list's fields set after WriteHeader are replayed, no others", k, got, want)
		}
	}
	s.wantRuns(1)

	plain, _ := s.call("POST", "/v1/charges", "", `{}`)
	if plain.StatusCode != http.StatusCreated {
		t.Fatalf("without a key: %d", plain.StatusCode)
	}
	for _, k := range []string{"Location", "X-Late", "Content-Language"} {
		if got := plain.Header.Get(k); got != "" {
			t.Errorf("without a key, net/http sent %s = %q, set after WriteHeader; it drops such fields", k, got)
		}
	}
}

// TestUncoveredMethodsPassThrough: a key sent with a method the middleware
// does not cover is not honoured, and the answer says so.
func TestUncoveredMethodsPassThrough(t *testing.T) {
	s := newServer(t, []engine.Option{engine.WithKeyRequired()}, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("/v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, r.Method)
		})))
	})
	for _, method := range []string{"GET", "PUT", "DELETE"} {
		for range 2 {
			resp, body := s.call(method, "/v1/charges", `"k1"`, "")
			if resp.StatusCode != http.StatusOK || string(body) != method || resp.Header.Get(idemkey.ReplayedHeader) != "" ||
				!idemkey.ParseIgnored(resp.Header.Values(idemkey.StatusHeader)) {
				t.Fatalf("%s: %d %q %v", method, resp.StatusCode, body, resp.Header)
			}
		}
	}
	s.wantRuns(6)
	// A key is required of the covered methods only.
	resp, body := s.call("POST", "/v1/charges", "", "{}")
	wantProblem(t, resp, body, http.StatusBadRequest, idemkey.ReasonKeyMissing)
	resp, body = s.call("PATCH", "/v1/charges", "", "{}")
	wantProblem(t, resp, body, http.StatusBadRequest, idemkey.ReasonKeyMissing)
	s.wantRuns(6)
}

func TestOperationIsTheRoutePattern(t *testing.T) {
	var names []string
	handler := func(s *server) http.Handler {
		return s.handler(func(w http.ResponseWriter, r *http.Request) {
			names = append(names, idemhttp.OperationName(r.Context()))
			w.WriteHeader(http.StatusCreated)
		})
	}
	t.Run("per route", func(t *testing.T) {
		names = nil
		s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges/{id}/capture", mw(handler(s)))
			mux.Handle("POST /v1/refunds", mw(handler(s)))
		})
		// One key on two routes is two keys; on two paths of one route, it is
		// reused with another request.
		for _, path := range []string{"/v1/charges/ch_1/capture", "/v1/refunds"} {
			if resp, body := s.call("POST", path, `"k1"`, "{}"); resp.StatusCode != http.StatusCreated {
				t.Fatalf("%s: %d %q", path, resp.StatusCode, body)
			}
		}
		resp, body := s.call("POST", "/v1/charges/ch_2/capture", `"k1"`, "{}")
		wantProblem(t, resp, body, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused)
		s.wantRuns(2)
		if strings.Join(names, ",") != "POST /v1/charges/{id}/capture,POST /v1/refunds" {
			t.Fatalf("operations %q", names)
		}
	})
	t.Run("around the mux", func(t *testing.T) {
		names = nil
		s := &server{t: t}
		mw, err := idemhttp.Middleware(newEngine(t, memory.New(), engine.WithTenant(tenantFromContext)))
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.Handle("POST /v1/charges", handler(s))
		mux.Handle("POST /v1/refunds", handler(s))
		srv := httptest.NewServer(authenticate(mw(mux)))
		t.Cleanup(srv.Close)
		s.url = srv.URL
		// No pattern reaches the middleware: the method is the operation, so
		// one key names one request across paths.
		if resp, body := s.call("POST", "/v1/charges", `"k1"`, "{}"); resp.StatusCode != http.StatusCreated {
			t.Fatalf("%d %q", resp.StatusCode, body)
		}
		resp, body := s.call("POST", "/v1/refunds", `"k1"`, "{}")
		wantProblem(t, resp, body, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused)
		s.wantRuns(1)
		if strings.Join(names, ",") != "POST" {
			t.Fatalf("operations %q", names)
		}
	})
}

func TestBodyTooLarge(t *testing.T) {
	var got []byte
	s := newServer(t, nil, []idemhttp.Option{idemhttp.WithMaxBodySize(16)}, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			got, _ = io.ReadAll(r.Body)
			w.WriteHeader(http.StatusCreated)
		})))
	})
	big := strings.Repeat("x", 17)
	resp, raw := s.call("POST", "/v1/charges", `"k1"`, big) // with a Content-Length
	wantProblem(t, resp, raw, http.StatusRequestEntityTooLarge, idemhttp.ReasonRequestTooLarge)

	req, _ := http.NewRequest("POST", s.url+"/v1/charges", io.MultiReader(strings.NewReader(big))) // chunked: no length
	req.Header.Set("Authorization", "Bearer acme")
	req.Header.Set(idemkey.KeyHeader, `"k1"`)
	if req.ContentLength != 0 {
		t.Fatalf("the request has a Content-Length of %d", req.ContentLength)
	}
	resp, raw = s.do(req)
	wantProblem(t, resp, raw, http.StatusRequestEntityTooLarge, idemhttp.ReasonRequestTooLarge)
	s.wantRuns(0)

	// Nothing was reserved: the key still runs a request that fits, and the
	// handler reads the body whole.
	small := `{"amount":16}` + "\x00\xff"
	if resp, raw = s.call("POST", "/v1/charges", `"k1"`, small); resp.StatusCode != http.StatusCreated {
		t.Fatalf("%d %q", resp.StatusCode, raw)
	}
	if string(got) != small {
		t.Fatalf("the handler read %q, want %q", got, small)
	}
	s.wantRuns(1)
	// Without a key the body is the handler's, whole.
	if resp, raw = s.call("POST", "/v1/charges", "", big); resp.StatusCode != http.StatusCreated || string(got) != big {
		t.Fatalf("%d %q; the handler read %q", resp.StatusCode, raw, got)
	}
}

// TestBodyReadAgain: the fingerprint function and then the handler each
// read the whole body from the request they get, whether the client sent
// its length or not, and whatever its size.
func TestBodyReadAgain(t *testing.T) {
	var fingerprinted, handled []byte
	fingerprint := func(r *http.Request, body []byte) (store.Fingerprint, error) {
		fingerprinted, _ = io.ReadAll(r.Body)
		return idemhttp.DefaultFingerprint(r, body)
	}
	s := newServer(t, nil, []idemhttp.Option{idemhttp.WithFingerprint(fingerprint)}, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			handled, _ = io.ReadAll(r.Body)
			w.WriteHeader(http.StatusCreated)
		})))
	})
	for i, body := range []string{"", "{}", strings.Repeat("0123456789", 100)} {
		for _, chunked := range []bool{false, true} {
			var from io.Reader = strings.NewReader(body)
			if chunked {
				from = io.MultiReader(from) // no length
			}
			req, _ := http.NewRequest("POST", s.url+"/v1/charges", from)
			req.Header.Set("Authorization", "Bearer acme")
			req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey("k"+strconv.Itoa(i)+strconv.FormatBool(chunked)))
			if resp, raw := s.do(req); resp.StatusCode != http.StatusCreated {
				t.Fatalf("%d %q", resp.StatusCode, raw)
			}
			if string(fingerprinted) != body || string(handled) != body {
				t.Fatalf("a body of %d bytes (chunked: %v): the fingerprint read %d bytes, the handler %d", len(body), chunked, len(fingerprinted), len(handled))
			}
		}
	}
	s.wantRuns(6)
}

func TestPanicReleasesTheKey(t *testing.T) {
	var calls atomic.Int64
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				_, _ = io.WriteString(w, "half a reply")
				panic(http.ErrAbortHandler) // net/http aborts the response, quietly
			}
			w.WriteHeader(http.StatusCreated)
		})))
	})
	req, _ := http.NewRequest("POST", s.url+"/v1/charges", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer acme")
	req.Header.Set(idemkey.KeyHeader, `"k1"`)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("the panicking request got a response: %d", resp.StatusCode)
	}
	if resp, raw := s.call("POST", "/v1/charges", `"k1"`, "{}"); resp.StatusCode != http.StatusCreated || resp.Header.Get(idemkey.ReplayedHeader) != "false" {
		t.Fatalf("retry: %d %q %v", resp.StatusCode, raw, resp.Header)
	}
	s.wantRuns(2)
}

func TestRecordedAndReleasedStatuses(t *testing.T) {
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/status/{code}", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			code, _ := strconv.Atoi(r.PathValue("code"))
			http.Error(w, "status", code)
		})))
	})
	for code, recorded := range map[int]bool{200: true, 302: true, 404: true, 410: true, 412: true, 500: true, 501: true,
		400: false, 401: false, 409: false, 422: false, 429: false, 502: false, 503: false, 504: false} {
		path := "/v1/status/" + strconv.Itoa(code)
		before := s.runs.Load()
		key := idemkey.FormatKey(path)
		s.call("POST", path, key, "{}")
		resp, _ := s.call("POST", path, key, "{}")
		replayed := resp.Header.Get(idemkey.ReplayedHeader) == "true"
		if resp.StatusCode != code || replayed != recorded || s.runs.Load()-before != map[bool]int64{true: 1, false: 2}[recorded] {
			t.Errorf("status %d: the retry got %d, replayed %v, after %d runs; want recorded %v",
				code, resp.StatusCode, replayed, s.runs.Load()-before, recorded)
		}
	}
}

func TestResponseTooLargeRecordsAProblem(t *testing.T) {
	s := newServer(t, []engine.Option{engine.WithMaxRecordSize(engine.MinRecordSize)}, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", "/v1/charges/ch_1")
			w.WriteHeader(http.StatusCreated)
			if _, err := io.WriteString(w, strings.Repeat("x", engine.MinRecordSize+1)); err == nil {
				t.Error("Write past the bound did not fail")
			}
		})))
	})
	first, firstBody := s.call("POST", "/v1/charges", `"k1"`, "{}")
	wantProblem(t, first, firstBody, http.StatusInternalServerError, idemhttp.ReasonResponseNotRecorded)
	if first.Header.Get("Location") != "" {
		t.Fatalf("the replaced response kept the handler's Location")
	}
	replay, replayBody := s.call("POST", "/v1/charges", `"k1"`, "{}")
	wantProblem(t, replay, replayBody, http.StatusInternalServerError, idemhttp.ReasonResponseNotRecorded)
	if !bytes.Equal(firstBody, replayBody) || replay.Header.Get(idemkey.ReplayedHeader) != "true" {
		t.Fatalf("replay %q, want %q marked replayed", replayBody, firstBody)
	}
	s.wantRuns(1)
}

func TestAnswers(t *testing.T) {
	block, started := make(chan struct{}), make(chan struct{}, 1)
	s := newServer(t, []engine.Option{engine.WithMaxRetryAfter(1500 * time.Millisecond)}, nil,
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Query().Get("block") != "" {
					started <- struct{}{}
					<-block
				}
				w.WriteHeader(http.StatusCreated)
			})))
		})

	t.Run("malformed key", func(t *testing.T) {
		resp, raw := s.call("POST", "/v1/charges", `"a secret key`, "{}")
		p := wantProblem(t, resp, raw, http.StatusBadRequest, idemkey.ReasonKeyInvalid)
		if strings.Contains(string(raw), "secret") || p.Detail == "" {
			t.Fatalf("problem %q", raw)
		}
	})
	t.Run("no tenant", func(t *testing.T) {
		req, _ := http.NewRequest("POST", s.url+"/v1/charges", strings.NewReader("{}"))
		req.Header.Set(idemkey.KeyHeader, `"k1"`)
		resp, raw := s.do(req)
		p := wantProblem(t, resp, raw, http.StatusUnauthorized, "")
		if p.Type != "about:blank" {
			t.Fatalf("type %q", p.Type)
		}
	})
	t.Run("in progress", func(t *testing.T) {
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.call("POST", "/v1/charges?block=1", `"k2"`, "{}")
		}()
		<-started
		resp, raw := s.call("POST", "/v1/charges?block=1", `"k2"`, "{}")
		wantProblem(t, resp, raw, http.StatusConflict, idemkey.ReasonInProgress)
		if ra := resp.Header.Get("Retry-After"); ra != "2" { // 1.5s, rounded up
			t.Fatalf("Retry-After %q, want 2", ra)
		}
		close(block)
		<-done
		if resp, _ := s.call("POST", "/v1/charges?block=1", `"k2"`, "{}"); resp.StatusCode != http.StatusCreated || resp.Header.Get(idemkey.ReplayedHeader) != "true" {
			t.Fatalf("after the first: %d %v", resp.StatusCode, resp.Header)
		}
	})
	t.Run("query is part of the request", func(t *testing.T) {
		s.call("POST", "/v1/charges?a=1", `"k3"`, "{}")
		resp, raw := s.call("POST", "/v1/charges?a=2", `"k3"`, "{}")
		wantProblem(t, resp, raw, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused)
	})
}

func TestMiddlewareRefusesMistakes(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithSingleTenant())
	if _, err := idemhttp.Middleware(eng, idemhttp.WithAtomic()); err == nil {
		t.Error("WithAtomic on the memory store: no error")
	}
	for _, name := range []string{"Set-Cookie", "set-cookie", "Content-Length", "Idempotent-Replayed", "idempotency-key-expires", "bad name"} {
		if _, err := idemhttp.Middleware(eng, idemhttp.WithReplayedHeaders(name)); err == nil {
			t.Errorf("WithReplayedHeaders(%q): no error", name)
		}
	}
	if _, err := idemhttp.Middleware(eng, idemhttp.WithReplayedHeaders("ETag")); err != nil {
		t.Errorf("WithReplayedHeaders(ETag): %v", err)
	}
}

// TestMiddlewareNeedsAnEngine checks that Middleware refuses, naming the
// fix, no engine, and an engine that cannot tell tenants apart, whose
// callers would all share one key space.
func TestMiddlewareNeedsAnEngine(t *testing.T) {
	if _, err := idemhttp.Middleware(nil); err == nil || !strings.Contains(err.Error(), "engine.New") {
		t.Errorf("no engine: %v, want an error that names engine.New", err)
	}
	_, err := idemhttp.Middleware(newEngine(t, memory.New()))
	if err == nil || !strings.Contains(err.Error(), "engine.WithTenant") {
		t.Errorf("an engine with neither WithTenant nor WithSingleTenant: %v, want an error that names engine.WithTenant", err)
	}
}

func TestWriteProblem(t *testing.T) {
	for _, tc := range []struct {
		retryAfter time.Duration
		want       string
	}{{0, ""}, {time.Nanosecond, "1"}, {time.Second, "1"}, {1001 * time.Millisecond, "2"}, {1<<63 - 1, "9223372037"}} {
		w := httptest.NewRecorder()
		idemhttp.WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreFull, "try later", tc.retryAfter)
		if got := w.Header().Get("Retry-After"); got != tc.want {
			t.Errorf("retryAfter %v: Retry-After %q, want %q", tc.retryAfter, got, tc.want)
		}
	}
	w := httptest.NewRecorder()
	idemhttp.WriteProblem(w, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused, "no", 0)
	want := `{"type":"https://idemkey.dev/problems/idempotency-key-reused","title":"Idempotency-Key is already used with another request","status":422,"detail":"no"}`
	if w.Code != 422 || w.Body.String() != want || w.Header().Get("Content-Type") != "application/problem+json" {
		t.Fatalf("got %d %s %v", w.Code, w.Body, w.Header())
	}
	for reason, typ := range map[string]string{
		idemkey.ReasonKeyMissing: "https://idemkey.dev/problems/idempotency-key-missing",
		"":                       "about:blank",
	} {
		w := httptest.NewRecorder()
		idemhttp.WriteProblem(w, http.StatusBadRequest, reason, "x", 0)
		var p idemhttp.Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Type != typ {
			t.Errorf("a problem of reason %q has type %q (%v), want %q", reason, p.Type, err, typ)
		}
		if got := idemhttp.ProblemReason(typ); got != reason {
			t.Errorf("ProblemReason(%q) = %q, want %q", typ, got, reason)
		}
	}
	if got := idemhttp.ProblemReason("https://example.com/problems/x"); got != "" {
		t.Errorf("a foreign type reads as reason %q", got)
	}
}

// TestForeignRecordIsRefused checks that a record the middleware cannot
// replay (another transport's, or a corrupt one) answers a clean 500.
func TestForeignRecordIsRefused(t *testing.T) {
	const operation = "/payments.v1.PaymentService/CreateCharge"
	fp := store.Fingerprint{1} // enginetest's
	st := memory.New()
	eng := newEngine(t, st, engine.WithSingleTenant(), engine.WithLogger(nil)) // writes the records the middleware must refuse
	for key, outcome := range map[string][]byte{
		"grpc":    mustMarshal(t, &idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Response{Response: []byte{}}}),
		"corrupt": {0xff, 0xff, 0xff},
		"status":  mustMarshal(t, &idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Http{Http: &idemkeyv1.HTTPResponse{Status: 42}}}),
	} {
		op, err := eng.Operation(engine.OperationSpec{Name: operation})
		if err != nil {
			t.Fatal(err)
		}
		if c := enginetest.Serve(t.Context(), eng, op, key, outcome); !c.Ran || c.Answered.Verdict != engine.Executed {
			t.Fatalf("recording the %s record: %+v", key, c.Answered)
		}
	}
	mw, err := idemhttp.Middleware(eng,
		idemhttp.WithOperation(func(*http.Request) string { return operation }),
		idemhttp.WithFingerprint(func(*http.Request, []byte) (store.Fingerprint, error) { return fp, nil }))
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++ })))
	t.Cleanup(srv.Close)
	s := &server{t: t, url: srv.URL}
	for _, key := range []string{"grpc", "corrupt", "status"} {
		resp, raw := s.call("POST", "/v1/charges", key, "{}")
		wantProblem(t, resp, raw, http.StatusInternalServerError, "")
	}
	if runs != 0 {
		t.Fatalf("the handler ran %d times", runs)
	}
}

func mustMarshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	raw, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// TestFingerprintErrorIsNotQuoted checks that a FingerprintFunc's error
// answers 400 and is logged at Warn with its type, never its words, which
// may quote the request.
func TestFingerprintErrorIsNotQuoted(t *testing.T) {
	logger, logs := logtest.New()
	refuse := func(*http.Request, []byte) (store.Fingerprint, error) {
		return store.Fingerprint{}, errors.New(`the field "card" holds 4242 4242 4242 4242`)
	}
	s := newServer(t, []engine.Option{engine.WithLogger(logger)}, []idemhttp.Option{idemhttp.WithFingerprint(refuse)},
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {})))
		})
	resp, raw := s.call("POST", "/v1/charges", `"k1"`, `{"card":"4242 4242 4242 4242"}`)
	wantProblem(t, resp, raw, http.StatusBadRequest, idemhttp.ReasonRequestUnreadable)
	s.wantRuns(0)
	out := logs.String()
	if strings.Contains(out, "4242") || strings.Contains(string(raw), "4242") {
		t.Fatalf("the log or the answer quotes the fingerprint's error: %s %s", out, raw)
	}
	if !strings.Contains(out, "level=WARN") || !strings.Contains(out, "*errors.errorString") {
		t.Fatalf("the log does not tell the fingerprint's refusal at Warn, by its type: %s", out)
	}
}

// orderWriter notes, in the list the hooks add to, when the status is
// written.
type orderWriter struct {
	*httptest.ResponseRecorder
	events *[]string
	wrote  bool
}

func (w *orderWriter) WriteHeader(status int) {
	if !w.wrote {
		w.wrote = true
		*w.events = append(*w.events, "status "+strconv.Itoa(status))
	}
	w.ResponseRecorder.WriteHeader(status)
}

func (w *orderWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseRecorder.Write(p)
}

// TestHooksRunBeforeTheAnswer checks the hooks' order: before the
// middleware writes the status of its own answer (a recorded, replayed or
// problem response), so that a client that has it knows the hook has
// returned; after a response the handler writes itself (no key).
func TestHooksRunBeforeTheAnswer(t *testing.T) {
	var events []string
	note := func(_ context.Context, ev engine.Event) {
		events = append(events, "hook "+ev.Verdict.String()+" "+strconv.Itoa(ev.Code))
	}
	eng := newEngine(t, memory.New(), engine.WithTenant(tenantFromContext), engine.WithLogger(nil),
		engine.WithHooks(engine.Hooks{OnExecute: note, OnReplay: note, OnRefuse: note}))
	mw, err := idemhttp.Middleware(eng)
	if err != nil {
		t.Fatal(err)
	}
	h := authenticate(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ch_1")
	})))
	for _, tc := range []struct {
		tenant, key, body string
		want              string
	}{
		{"acme", "k1", "{}", "hook executed 201, status 201"},
		{"acme", "k1", "{}", "hook replayed 201, status 201"},
		{"acme", "k1", `{"other":1}`, "hook reused 422, status 422"},
		{"", "k1", "{}", "hook refused 401, status 401"},
		{"acme", "", "{}", "status 201, hook no_key 201"},
	} {
		events = nil
		req := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(tc.body))
		if tc.tenant != "" {
			req.Header.Set("Authorization", "Bearer "+tc.tenant)
		}
		if tc.key != "" {
			req.Header.Set(idemkey.KeyHeader, tc.key)
		}
		h.ServeHTTP(&orderWriter{ResponseRecorder: httptest.NewRecorder(), events: &events}, req)
		if got := strings.Join(events, ", "); got != tc.want {
			t.Errorf("tenant %q, key %q, body %s: %s; want %s", tc.tenant, tc.key, tc.body, got, tc.want)
		}
	}
}

// A replay reads its body into a buffer that an earlier replay used: a
// shorter body, a prefix of the one before, is still another request. The
// replayed fields share one array, but an append to one field's values
// never writes over the next's.
func TestReplayBuffersAreNotShared(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithSingleTenant(), engine.WithLogger(nil))
	mw, err := idemhttp.Middleware(eng)
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Language"] = []string{"en", "fr"}
		w.Header().Set("Location", "/v1/charges/ch_1")
		w.WriteHeader(http.StatusCreated)
	}))
	call := func(body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(body))
		req.Header.Set(idemkey.KeyHeader, `"k1"`)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w
	}
	long := strings.Repeat("0123456789", 50)
	call(long)
	for range 3 {
		if w := call(long); w.Code != http.StatusCreated || w.Header().Get(idemkey.ReplayedHeader) != "true" {
			t.Fatalf("replay: %d %v", w.Code, w.Header())
		}
		if w := call(long[:100]); w.Code != http.StatusUnprocessableEntity {
			t.Fatalf("a prefix of the body: %d; want 422", w.Code)
		}
	}
	w := call(long)
	hdr := w.Header()
	hdr["Content-Language"] = append(hdr["Content-Language"], "de")
	hdr["Expires"] = append(hdr[idemkey.ExpiresHeader], "x")
	if got := strings.Join(hdr["Location"], "|"); got != "/v1/charges/ch_1" {
		t.Fatalf("Location = %q after an append to Content-Language", got)
	}
	if w := call(long); strings.Join(w.Header()["Content-Language"], "|") != "en|fr" || len(w.Header()[idemkey.ExpiresHeader]) != 1 {
		t.Fatalf("the next replay: %v", w.Header())
	}
}

// A handler may keep its request past its return, against net/http's
// advice: what it reads later is still its own body, however many requests
// the middleware served since (an exchange is reused; what the handler got
// of it never is).
func TestKeptRequestKeepsItsBody(t *testing.T) {
	kept := make(chan *http.Request, 8)
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			kept <- r
			w.WriteHeader(http.StatusCreated)
		})))
	})
	const first = `{"amount": 1}`
	s.call("POST", "/v1/charges", `"k-kept"`, first)
	r := <-kept
	for i := range 50 { // replays and first calls, whose exchanges come from the pool
		s.call("POST", "/v1/charges", `"k-kept"`, first)
		s.call("POST", "/v1/charges", `"k-`+strconv.Itoa(i)+`"`, strings.Repeat("x", 40))
		<-kept
	}
	s.wantRuns(51)
	got, err := io.ReadAll(r.Body)
	if err != nil || string(got) != first {
		t.Fatalf("the kept request's body reads %q, %v; want %q", got, err, first)
	}
}

// A response that is not sent, since a step of its handler ended the call
// (a retry finds the step started, never finished), leaves none of its header fields on the answer
// that is: the problem carries the fields of the middleware before, and
// no more.
func TestUnsentResponseLeavesNoFields(t *testing.T) {
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		charge := mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Location", "/v1/charges/ch_1")
			w.Header().Set("X-Charge-Id", "ch_1")
			w.Header().Del("X-Before-Deleted")
			if _, err := engine.Step(r.Context(), "charge", func(context.Context) (int, error) {
				return 0, errors.New("the processor timed out")
			}, nil); err != nil {
				w.WriteHeader(http.StatusBadGateway) // not recorded: the key is released, its step started
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
		mux.Handle("POST /v1/charges", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Before", "kept")
			w.Header().Set("X-Before-Deleted", "kept too")
			charge.ServeHTTP(w, r)
		}))
	})
	if resp, _ := s.call("POST", "/v1/charges", `"k-unsent"`, `{}`); resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("the first call answered %d, want the handler's 502", resp.StatusCode)
	}
	resp, raw := s.call("POST", "/v1/charges", `"k-unsent"`, `{}`) // finds its step started, never finished
	wantProblem(t, resp, raw, http.StatusInternalServerError, idemkey.ReasonOutcomeUnknown)
	s.wantRuns(2)
	for _, k := range []string{"Location", "X-Charge-Id"} {
		if v := resp.Header.Get(k); v != "" {
			t.Errorf("the problem carries the unsent response's %s: %q", k, v)
		}
	}
	for _, k := range []string{"X-Before", "X-Before-Deleted"} {
		if v := resp.Header.Get(k); v == "" {
			t.Errorf("the problem lost the middleware before's %s", k)
		}
	}
}

// Many requests at once, first calls and replays of their own keys, each
// get their own answer: nothing of one exchange leaks into another's,
// however the middleware reuses them.
func TestConcurrentRequestsGetTheirOwnAnswers(t *testing.T) {
	s := newServer(t, nil, nil, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			w.Header().Set("X-Echo", string(body))
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(body)
		})))
	})
	const goroutines, calls = 16, 40
	errs := make(chan error, goroutines)
	for g := range goroutines {
		go func() {
			errs <- func() error {
				for i := range calls {
					key, body := `"k-`+strconv.Itoa(g)+"-"+strconv.Itoa(i)+`"`, `{"n": "`+strconv.Itoa(g*calls+i)+`"}`
					for attempt, replayed := range []string{"false", "true"} {
						req, err := http.NewRequest("POST", s.url+"/v1/charges", strings.NewReader(body))
						if err != nil {
							return err
						}
						req.Header.Set("Authorization", "Bearer acme")
						req.Header.Set(idemkey.KeyHeader, key)
						resp, err := http.DefaultClient.Do(req)
						if err != nil {
							return err
						}
						got, err := io.ReadAll(resp.Body)
						resp.Body.Close()
						if err != nil {
							return err
						}
						echo := resp.Header.Get("X-Echo") // a first call's own field, not on the replay list
						if string(got) != body || (attempt == 0) != (echo == body) || resp.Header.Get(idemkey.ReplayedHeader) != replayed {
							return fmt.Errorf("call %d of %s, attempt %d: %d %q, X-Echo %q, replayed %q; want %q, replayed %s",
								i, key, attempt, resp.StatusCode, got, echo, resp.Header.Get(idemkey.ReplayedHeader), body, replayed)
						}
					}
				}
				return nil
			}()
		}()
	}
	for range goroutines {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	s.wantRuns(goroutines * calls)
}
