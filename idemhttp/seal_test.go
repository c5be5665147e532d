package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// credentials answers 201 with a vended secret, as a route that issues
// credentials does.
func credentials(s *server) http.Handler {
	return s.handler(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/credentials/cred_1")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"cred_1","secret":"sk_live_secret"}`))
	})
}

// redactSecret removes the secret from a recorded JSON body.
func redactSecret(_ *http.Request, reply *idemhttp.Reply) {
	var body map[string]any
	if err := json.Unmarshal(reply.Body, &body); err != nil {
		panic(err)
	}
	delete(body, "secret")
	reply.Body, _ = json.Marshal(body)
	reply.Header.Del("Location")
}

func TestRedaction(t *testing.T) {
	s := newServer(t, nil, []idemhttp.Option{idemhttp.WithRedaction(redactSecret)}, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
		mux.Handle("POST /v1/credentials", mw(credentials(s)))
	})
	first, body := s.call("POST", "/v1/credentials", "k1", `{}`)
	if first.StatusCode != http.StatusCreated || !strings.Contains(string(body), "sk_live_secret") || first.Header.Get("Location") == "" {
		t.Fatalf("first: %d %s %v; want the whole response", first.StatusCode, body, first.Header)
	}
	for range 2 {
		replay, body := s.call("POST", "/v1/credentials", "k1", `{}`)
		if replay.StatusCode != http.StatusCreated || string(body) != `{"id":"cred_1"}` ||
			replay.Header.Get("Location") != "" || replay.Header.Get("Content-Type") != "application/json" ||
			replay.Header.Get(idemkey.ReplayedHeader) != "true" {
			t.Fatalf("replay: %d %s %v; want the redacted response, marked replayed", replay.StatusCode, body, replay.Header)
		}
	}
	s.wantRuns(1)
}

// A redaction that panics, or leaves a status that is not final, records a
// 500 in place of the response, which the first caller gets too: the
// handler has run, so its key is not released.
func TestRedactionThatFails(t *testing.T) {
	for name, redact := range map[string]idemhttp.RedactFunc{
		"panics":        func(*http.Request, *idemhttp.Reply) { panic("redaction bug") },
		"not a status":  func(_ *http.Request, r *idemhttp.Reply) { r.Status = 100 },
		"out of bounds": func(_ *http.Request, r *idemhttp.Reply) { r.Status = 1000 },
	} {
		t.Run(name, func(t *testing.T) {
			s := newServer(t, nil, []idemhttp.Option{idemhttp.WithRedaction(redact)}, func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
				mux.Handle("POST /v1/credentials", mw(credentials(s)))
			})
			for range 2 {
				resp, body := s.call("POST", "/v1/credentials", "k1", `{}`)
				wantProblem(t, resp, body, http.StatusInternalServerError, idemhttp.ReasonResponseNotRecorded)
				if strings.Contains(string(body), "secret") {
					t.Fatalf("the 500 holds the response: %s", body)
				}
			}
			s.wantRuns(1)
		})
	}
}

// The 500 that takes the place of a response that cannot be recorded fits
// in store.SmallOutcome before sealing, and in the envelope's Overhead more
// after: a store with bounds sets that much aside when the key is reserved
// (the engine counts the Overhead in store.Reservation.MaxOutcome), so the
// sealed stand-in is recorded whatever room the reply would have needed.
func TestSealedStandInIsSmall(t *testing.T) {
	ring, err := seal.NewKeyRing(bytes.Repeat([]byte{1}, seal.KeySize))
	if err != nil {
		t.Fatal(err)
	}
	st := &sizes{Store: memory.New()}
	eng := newEngine(t, st, engine.WithSingleTenant(), engine.WithSealer(ring), engine.WithMaxRecordSize(1024), engine.WithLogger(nil))
	mw, err := idemhttp.Middleware(eng, idemhttp.WithReplayedHeaders("X-Long-Header-Name-Replayed"))
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Long-Header-Name-Replayed", strings.Repeat("v", 200))
		_, _ = w.Write(bytes.Repeat([]byte("x"), 4096))
	}))
	rec := httptest.NewRecorder()
	req, _ := http.NewRequest("POST", "/v1/x", strings.NewReader("{}"))
	req.Header.Set(idemkey.KeyHeader, "k1")
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusInternalServerError || len(st.completed) != 1 {
		t.Fatalf("got %d, %d records; want the 500 recorded", rec.Code, len(st.completed))
	}
	if n := st.completed[0]; n > store.SmallOutcome+seal.Overhead {
		t.Fatalf("the sealed stand-in takes %d bytes, more than store.SmallOutcome (%d) and the envelope", n, store.SmallOutcome)
	}
}

// sizes is a store that notes the size of every outcome it completes.
type sizes struct {
	store.Store
	mu        sync.Mutex
	completed []int
}

func (s *sizes) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	s.mu.Lock()
	s.completed = append(s.completed, len(outcome))
	s.mu.Unlock()
	return s.Store.Complete(ctx, key, token, outcome)
}

// A redaction function's panic is logged with its value's type, never the
// value, which may quote the response it was redacting; the response is
// still replaced by a recorded 500, for the first caller and every retry.
func TestRedactionPanicIsNotQuoted(t *testing.T) {
	logger, logs := logtest.New()
	redact := func(*http.Request, *idemhttp.Reply) { panic("cannot redact the card 4242 4242 4242 4242") }
	s := newServer(t, []engine.Option{engine.WithLogger(logger)}, []idemhttp.Option{idemhttp.WithRedaction(redact)},
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/credentials", mw(credentials(s)))
		})
	first, firstBody := s.call("POST", "/v1/credentials", "k1", `{}`)
	wantProblem(t, first, firstBody, http.StatusInternalServerError, idemhttp.ReasonResponseNotRecorded)
	replay, replayBody := s.call("POST", "/v1/credentials", "k1", `{}`)
	wantProblem(t, replay, replayBody, http.StatusInternalServerError, idemhttp.ReasonResponseNotRecorded)
	if !bytes.Equal(firstBody, replayBody) || replay.Header.Get(idemkey.ReplayedHeader) != "true" {
		t.Fatalf("replay %q, want the recorded 500 %q, marked replayed", replayBody, firstBody)
	}
	s.wantRuns(1)
	out := logs.String()
	if strings.Contains(out, "4242") {
		t.Fatalf("the log quotes the redaction's panic: %s", out)
	}
	if !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "redaction function panicked") || !strings.Contains(out, "type string") {
		t.Fatalf("the log does not tell that the redaction function panicked, and with what type: %s", out)
	}
}
