package idemhttp_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

func TestMetrics(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	s := newServer(t, []engine.Option{engine.WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))}, nil,
		func(s *server, mw func(http.Handler) http.Handler, mux *http.ServeMux) {
			mux.Handle("POST /v1/charges/{id}", mw(s.handler(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			})))
		})
	s.call("POST", "/v1/charges/ch_1", `"k1"`, "{}")
	s.call("POST", "/v1/charges/ch_1", `"k1"`, "{}")
	s.call("POST", "/v1/charges/ch_1", `"k1"`, `{"other":1}`)

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "idemkey.calls" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				var parts []string
				for _, kv := range dp.Attributes.ToSlice() {
					parts = append(parts, string(kv.Key)+"="+kv.Value.String())
				}
				got[strings.Join(parts, " ")] += dp.Value
			}
		}
	}
	want := map[string]int64{
		"http.request.method=POST http.response.status_code=201 http.route=/v1/charges/{id} idemkey.outcome=executed": 1,
		"http.request.method=POST http.response.status_code=201 http.route=/v1/charges/{id} idemkey.outcome=replayed": 1,
		"http.request.method=POST http.response.status_code=422 http.route=/v1/charges/{id} idemkey.outcome=reused":   1,
	}
	if len(got) != len(want) {
		t.Fatalf("idemkey.calls: %v, want %v", got, want)
	}
	for k, n := range want {
		if got[k] != n {
			t.Fatalf("idemkey.calls: %v, want %v", got, want)
		}
	}
}

// TestFingerprintIsPinned pins the default fingerprint: records made by one
// release must match requests read by the next.
func TestFingerprintIsPinned(t *testing.T) {
	var got store.Fingerprint
	mw, err := idemhttp.Middleware(newEngine(t, memory.New(), engine.WithSingleTenant(), engine.WithLogger(nil)), idemhttp.WithFingerprint(func(r *http.Request, body []byte) (store.Fingerprint, error) {
		got, _ = idemhttp.DefaultFingerprint(r, body)
		return got, errors.New("taken") // answers 400 before the store
	}))
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges/{id}", mw(http.NotFoundHandler()))
	body := `{"amount":1}`
	r := httptest.NewRequest("POST", "/v1/charges/a%2Fb?x=1", strings.NewReader(body))
	r.Header.Set("Content-Type", "Application/JSON; charset=utf-8")
	r.Header.Set(idemkey.KeyHeader, `"k1"`)
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, r)
	if w.Code != http.StatusBadRequest {
		t.Fatalf("status %d, want 400 from the refusing fingerprint", w.Code)
	}

	b := store.AppendParts(nil, "idemhttp v1", "POST", "POST /v1/charges/{id}", "/v1/charges/a%2Fb", "x=1", "application/json", body)
	if want := store.Fingerprint(sha256.Sum256(b)); got != want {
		t.Fatalf("fingerprint %x, want %x", got, want)
	}
	if h := hex.EncodeToString(got[:]); h != pinnedFingerprint {
		t.Fatalf("fingerprint %s, pinned %s", h, pinnedFingerprint)
	}
}

const pinnedFingerprint = "365840683571db6d826b3c1f8b183f8fd2d974e95c387ddd91be9978fad743cc"
