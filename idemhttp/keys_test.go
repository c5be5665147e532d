package idemhttp_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// keysServer serves POST /v1/charges behind the middleware and GET
// /v1/idempotency-keys/{key} by KeyHandler, on one engine and options.
type keysServer struct {
	*server
	release chan struct{} // a charge waits for it, if not nil
	started chan struct{}
}

const chargesOp = "POST /v1/charges"

func newKeysServer(t *testing.T, st store.Store, opts ...idemhttp.Option) *keysServer {
	t.Helper()
	eng := newEngine(t, st, engine.WithTenant(tenantFromContext), engine.WithLogger(nil), engine.WithInProgressWait(0), engine.WithRetention(time.Hour))
	mw, err := idemhttp.Middleware(eng, opts...)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := idemhttp.KeyHandler(eng, opts...)
	if err != nil {
		t.Fatal(err)
	}
	s := &keysServer{server: &server{t: t}}
	var n atomic.Int64
	mux := http.NewServeMux()
	mux.Handle(chargesOp, mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
		if s.started != nil {
			close(s.started)
			<-s.release
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/charges/ch_1")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"ch_` + strings.Repeat("x", int(n.Add(1))) + `"}`))
	})))
	mux.Handle("GET /v1/idempotency-keys/{key}", keys)
	srv := httptest.NewServer(authenticate(mux))
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

// getKey asks for key's state as tenant, with header's fields.
func (s *keysServer) getKey(tenant, key, op string, header ...string) (*http.Response, []byte) {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodGet, s.url+"/v1/idempotency-keys/"+url.PathEscape(key)+"?operation="+url.QueryEscape(op), nil)
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tenant)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return s.do(req)
}

type keyBody struct {
	State      string   `json:"state"`
	RetryAfter int64    `json:"retry_after"`
	StepsDone  []string `json:"steps_done"`
	Expires    string   `json:"expires"`
}

func wantKeyState(t *testing.T, what string, resp *http.Response, raw []byte, state string) keyBody {
	t.Helper()
	var b keyBody
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("%s: %d %s %q; want 200 application/json", what, resp.StatusCode, resp.Header.Get("Content-Type"), raw)
	}
	if err := json.Unmarshal(raw, &b); err != nil || b.State != state || b.StepsDone == nil {
		t.Fatalf("%s: %q (%v); want state %q and a list of steps", what, raw, err, state)
	}
	return b
}

// A key's state over HTTP in each of its states; the completed one is the
// response a retry gets, byte for byte; another tenant is told nothing.
func TestKeyHandlerStates(t *testing.T) {
	s := newKeysServer(t, memory.New())
	resp, raw := s.getKey("acme", "key/1", chargesOp)
	wantKeyState(t, "a new key", resp, raw, "unknown")

	s.started, s.release = make(chan struct{}), make(chan struct{})
	type reply struct {
		resp *http.Response
		raw  []byte
	}
	done := make(chan reply, 1)
	go func() {
		resp, raw := s.call(http.MethodPost, "/v1/charges", "key/1", `{"amount":100}`)
		done <- reply{resp, raw}
	}()
	<-s.started
	resp, raw = s.getKey("acme", "key/1", chargesOp)
	b := wantKeyState(t, "a running key", resp, raw, "in_progress")
	if b.RetryAfter < 1 || resp.Header.Get("Retry-After") == "" || b.Expires == "" || resp.Header.Get(idemkey.ExpiresHeader) != b.Expires {
		t.Errorf("a running key: %q, Retry-After %q, expiry header %q; want a wait and the expiry", raw, resp.Header.Get("Retry-After"), resp.Header.Get(idemkey.ExpiresHeader))
	}
	close(s.release)
	firstReply := <-done
	s.started = nil

	resp, raw = s.getKey("acme", "key/1", chargesOp)
	retry, retryRaw := s.call(http.MethodPost, "/v1/charges", "key/1", `{"amount":100}`)
	if resp.StatusCode != http.StatusCreated || string(raw) != string(firstReply.raw) || resp.Header.Get("Location") != "/v1/charges/ch_1" ||
		resp.Header.Get(idemkey.ReplayedHeader) != "true" || resp.Header.Get(idemkey.ExpiresHeader) != b.Expires {
		t.Errorf("a completed key: %d %v %q; want the first response, 201 %q, replayed, expiring %s", resp.StatusCode, resp.Header, raw, firstReply.raw, b.Expires)
	}
	if retry.StatusCode != resp.StatusCode || string(retryRaw) != string(raw) || retry.Header.Get(idemkey.ReplayedHeader) != "true" {
		t.Errorf("a retry: %d %q; want what the key handler told: %d %q", retry.StatusCode, retryRaw, resp.StatusCode, raw)
	}
	s.wantRuns(1)

	resp, raw = s.getKey("globex", "key/1", chargesOp)
	wantKeyState(t, "acme's key asked by globex", resp, raw, "unknown")
	stale := idemkey.FormatDate(time.Now().Add(-2 * time.Hour))
	resp, raw = s.getKey("acme", "key-2", chargesOp, idemkey.FirstSentHeader, stale)
	wantKeyState(t, "a key first sent two hours ago", resp, raw, "expired")
	req, _ := http.NewRequest(http.MethodPost, s.url+"/v1/charges", strings.NewReader(`{"amount":100}`))
	req.Header.Set("Authorization", "Bearer acme")
	req.Header.Set(idemkey.KeyHeader, "key-2")
	req.Header.Set(idemkey.FirstSentHeader, stale)
	resp, raw = s.do(req)
	wantProblem(t, resp, raw, http.StatusPreconditionFailed, idemkey.ReasonKeyExpired) // as the key handler told
}

// The key handler's refusals, as problems.
func TestKeyHandlerRefusals(t *testing.T) {
	s := newKeysServer(t, memory.New())
	for _, op := range []string{"", "GET /v1/charges/{id}"} { // missing, not covered
		resp, raw := s.getKey("acme", "key-1", op)
		wantProblem(t, resp, raw, http.StatusBadRequest, "")
	}
	resp, raw := s.getKey("acme", "bad key", chargesOp)
	wantProblem(t, resp, raw, http.StatusBadRequest, idemkey.ReasonKeyInvalid)
	if strings.Contains(string(raw), "bad key") {
		t.Errorf("the problem quotes the key: %s", raw)
	}
	resp, raw = s.getKey("acme", "key-1", chargesOp, idemkey.FirstSentHeader, "yesterday")
	wantProblem(t, resp, raw, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid)
	resp, raw = s.getKey("", "key-1", chargesOp, "Authorization", "")
	wantProblem(t, resp, raw, http.StatusUnauthorized, "")

	plain := newKeysServer(t, plainStore{memory.New()})
	resp, raw = plain.getKey("acme", "key-1", chargesOp)
	wantProblem(t, resp, raw, http.StatusNotImplemented, "")

	if _, err := idemhttp.KeyHandler(nil); err == nil {
		t.Error("KeyHandler(nil) = nil error; want one")
	}
}

// plainStore is a store that is no store.Looker.
type plainStore struct{ store.Store }

// Mounted without a pattern, the key is the path's last segment, unescaped.
func TestKeyHandlerLastSegment(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithSingleTenant())
	keys, err := idemhttp.KeyHandler(eng)
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	keys.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/keys/a%2Fb?operation=POST", nil))
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"state":"unknown"`) {
		t.Errorf("GET /keys/a%%2Fb = %d %q; want 200 unknown", rec.Code, rec.Body)
	}
	rec = httptest.NewRecorder()
	keys.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/keys/k?operation=POST", nil))
	if rec.Code != http.StatusMethodNotAllowed || !slices.Contains(strings.Split(rec.Header().Get("Allow"), ", "), "GET") {
		t.Errorf("POST to the key handler = %d, Allow %q; want 405 allowing GET", rec.Code, rec.Header().Get("Allow"))
	}
}

// On a region's server, a key first sent to another region and not yet
// copied is told in progress, with a Retry-After, as its request is
// answered; the header malformed is refused as a request's is.
func TestKeyHandlerFirstRegion(t *testing.T) {
	eng := newEngine(t, memory.New(), engine.WithTenant(tenantFromContext), engine.WithLogger(nil), engine.WithRegion("a"))
	keys, err := idemhttp.KeyHandler(eng)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /v1/idempotency-keys/{key}", keys)
	srv := httptest.NewServer(authenticate(mux))
	t.Cleanup(srv.Close)
	s := &keysServer{server: &server{t: t, url: srv.URL}}

	resp, raw := s.getKey("acme", "key-1", chargesOp, idemkey.FirstRegionHeader, "b")
	if b := wantKeyState(t, "first sent to b", resp, raw, "in_progress"); b.RetryAfter <= 0 || resp.Header.Get("Retry-After") == "" {
		t.Errorf("first sent to b: %q, Retry-After %q; want a retry delay", raw, resp.Header.Get("Retry-After"))
	}
	resp, raw = s.getKey("acme", "key-1", chargesOp, idemkey.FirstRegionHeader, "a")
	wantKeyState(t, "first sent to a", resp, raw, "unknown")
	resp, raw = s.getKey("acme", "key-1", chargesOp, idemkey.FirstRegionHeader, "Secret-B")
	wantProblem(t, resp, raw, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid)
	if strings.Contains(strings.ToLower(string(raw)), "secret") {
		t.Errorf("the problem quotes the region: %s", raw)
	}
}
