package idemhttp_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store/memory"
)

// A request tells when it was first sent; the middleware refuses one first
// sent before the retention whose key has no record, and tells every answer
// about a key until when it is honoured.
func TestFirstSentAndExpiry(t *testing.T) {
	const retention, skew = time.Hour, time.Minute
	s := newServer(t, []engine.Option{engine.WithRetention(retention), engine.WithClockSkew(skew)}, nil,
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			})))
		})
	send := func(key, firstSent string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequest("POST", s.url+"/v1/charges", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer acme")
		req.Header.Set(idemkey.KeyHeader, key)
		if firstSent != "" {
			req.Header.Set(idemkey.FirstSentHeader, firstSent)
		}
		return s.do(req)
	}

	t.Run("first sent before the retention", func(t *testing.T) {
		resp, raw := send(`"k1"`, idemkey.FormatDate(time.Now().Add(-retention-time.Minute)))
		p := wantProblem(t, resp, raw, http.StatusPreconditionFailed, idemkey.ReasonKeyExpired)
		if p.Type != "https://idemkey.dev/problems/idempotency-key-expired" || !strings.Contains(p.Detail, "not run") {
			t.Fatalf("problem %+v", p)
		}
		if _, ok := idemkey.ParseExpires(resp.Header.Values(idemkey.ExpiresHeader)); ok {
			t.Fatalf("expiry %q for a key that has no record", resp.Header.Get(idemkey.ExpiresHeader))
		}
		s.wantRuns(0)
	})
	t.Run("first sent in the future, beyond the skew", func(t *testing.T) {
		future := idemkey.FormatDate(time.Now().Add(2 * skew))
		for _, v := range []string{future, "not a date"} {
			resp, raw := send(`"k2"`, v)
			p := wantProblem(t, resp, raw, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid)
			if strings.Contains(string(raw), v) || p.Detail == "" {
				t.Fatalf("problem %q quotes the value %q", raw, v)
			}
		}
		s.wantRuns(0)
	})
	t.Run("a recent call and its replay tell the expiry", func(t *testing.T) {
		sent := time.Now()
		resp, _ := send(`"k3"`, idemkey.FormatDate(sent.Add(skew/2))) // within the skew
		exp, ok := idemkey.ParseExpires(resp.Header.Values(idemkey.ExpiresHeader))
		if resp.StatusCode != http.StatusCreated || !ok {
			t.Fatalf("got %d with expiry %q, want 201 with one", resp.StatusCode, resp.Header.Get(idemkey.ExpiresHeader))
		}
		if d := exp.Sub(sent); d < retention-time.Second || d > retention+time.Second {
			t.Fatalf("expires %v after the call, want the retention, %v", d, retention)
		}
		// A stale retry of a key with a record replays it.
		replay, _ := send(`"k3"`, idemkey.FormatDate(sent.Add(-retention-time.Minute)))
		if got, _ := idemkey.ParseExpires(replay.Header.Values(idemkey.ExpiresHeader)); replay.Header.Get(idemkey.ReplayedHeader) != "true" || !got.Equal(exp) {
			t.Fatalf("retry: %d %v, want the replay with the expiry %v", replay.StatusCode, replay.Header, exp)
		}
		s.wantRuns(1)
	})
}

// TestRetention: the middleware's own retention (WithRetention) is its
// keys' expiry, and decides which stale retries are refused; one shorter
// than the engine's longest lease is refused at start-up.
func TestRetention(t *testing.T) {
	const month = 31 * 24 * time.Hour
	s := newServer(t, []engine.Option{engine.WithRetention(time.Hour)}, []idemhttp.Option{idemhttp.WithRetention(month)},
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			})))
		})
	send := func(key string, firstSent time.Time) *http.Response {
		t.Helper()
		req, err := http.NewRequest("POST", s.url+"/v1/charges", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer acme")
		req.Header.Set(idemkey.KeyHeader, key)
		req.Header.Set(idemkey.FirstSentHeader, idemkey.FormatDate(firstSent))
		resp, _ := s.do(req)
		return resp
	}
	before := time.Now().Truncate(time.Second)
	resp := send(`"k1"`, time.Now().Add(-48*time.Hour)) // stale for the engine's hour, not for a month
	expires, ok := idemkey.ParseExpires(resp.Header.Values(idemkey.ExpiresHeader))
	if resp.StatusCode != http.StatusCreated || !ok || expires.Before(before.Add(month)) || expires.After(time.Now().Add(month)) {
		t.Fatalf("status %d, expiry %v; want 201, told a month from now", resp.StatusCode, expires)
	}
	s.wantRuns(1)
	eng := newEngine(t, memory.New(), engine.WithSingleTenant(), engine.WithLogger(nil))
	if _, err := idemhttp.Middleware(eng, idemhttp.WithRetention(time.Second)); err == nil || !strings.Contains(err.Error(), "engine.WithMaxLease") {
		t.Fatalf("a retention shorter than the longest lease: %v, want a refusal naming engine.WithMaxLease", err)
	}
}
