// Package httpadapter is the net/http entry point (idemhttp) as
// adaptertest runs it: a server of its own in front of the suite's Service,
// and a client in the suite's terms. idemhttp's tests run the suite through
// it on the core's stores, and a store of its own module (store/spanner) on
// its own.
package httpadapter

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/adaptertest"
)

// Adapter is the suite's net/http adapter.
func Adapter() adaptertest.Adapter {
	return adaptertest.Adapter{
		Name:  "http",
		Serve: serve,
		Status: map[string]int{
			idemkey.ReasonKeyMissing:       http.StatusBadRequest,
			idemkey.ReasonKeyInvalid:       http.StatusBadRequest,
			idemkey.ReasonKeyReused:        http.StatusUnprocessableEntity,
			idemkey.ReasonInProgress:       http.StatusConflict,
			idemkey.ReasonStoreUnavailable: http.StatusServiceUnavailable,
			idemkey.ReasonStoreFull:        http.StatusServiceUnavailable,
			idemkey.ReasonKeyExpired:       http.StatusPreconditionFailed,
			idemkey.ReasonFirstSentInvalid: http.StatusBadRequest,
			idemkey.ReasonOutcomeUnknown:   http.StatusInternalServerError,
			"internal":                     http.StatusInternalServerError,
		},
	}
}

type tenantKey struct{}

// Authenticate puts the tenant of "Authorization: Bearer TENANT" in the
// request's context, as an application's authentication middleware does.
func Authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tenant, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			r = r.WithContext(context.WithValue(r.Context(), tenantKey{}, tenant))
		}
		next.ServeHTTP(w, r)
	})
}

// TenantFromContext is the tenant Authenticate put in ctx.
func TenantFromContext(ctx context.Context) (string, error) {
	tenant, ok := ctx.Value(tenantKey{}).(string)
	if !ok {
		return "", fmt.Errorf("no tenant")
	}
	return tenant, nil
}

type chargeRequest struct {
	Amount      int64  `json:"amount"`
	Description string `json:"description"`
}

type charge struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// chargeHandler is the suite's Service behind POST /v1/charges: the
// description names the behaviour.
func chargeHandler(svc *adaptertest.Service) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req chargeRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, "bad json", http.StatusBadRequest)
			return
		}
		tenant, _ := TenantFromContext(r.Context())
		id, res := svc.Handle(r.Context(), tenant, req.Amount, req.Description)
		switch res {
		case adaptertest.Recorded:
			http.Error(w, "declined "+id, http.StatusNotFound)
			return
		case adaptertest.Released:
			http.Error(w, "try later "+id, http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/charges/"+id)
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(charge{ID: id, Amount: req.Amount})
	})
}

// redactConformance is the suite's redaction (adaptertest.Redact) in HTTP's
// terms: the body, and the Location that names the charge.
func redactConformance(_ *http.Request, reply *idemhttp.Reply) {
	reply.Body = []byte(adaptertest.Redact(string(reply.Body)))
	if loc := reply.Header.Get("Location"); loc != "" {
		reply.Header.Set("Location", adaptertest.Redact(loc))
	}
}

func serve(t *testing.T, cfg adaptertest.Config) func(context.Context, adaptertest.Request) adaptertest.Reply {
	var opts []idemhttp.Option
	if cfg.Atomic {
		opts = append(opts, idemhttp.WithAtomic())
	}
	if cfg.Redact {
		opts = append(opts, idemhttp.WithRedaction(redactConformance))
	}
	mw, err := idemhttp.Middleware(cfg.Engine(t, TenantFromContext), opts...)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw(chargeHandler(cfg.Service)))
	// A GET, which the middleware does not cover, runs the Service too: the
	// path names the behaviour.
	mux.Handle("GET /v1/charges/{behaviour}", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, _ := TenantFromContext(r.Context())
		id, res := cfg.Service.Handle(r.Context(), tenant, 0, r.PathValue("behaviour"))
		if res != adaptertest.OK {
			http.Error(w, "declined "+id, http.StatusNotFound)
			return
		}
		_ = json.NewEncoder(w).Encode(charge{ID: id})
	})))
	srv := httptest.NewServer(Authenticate(mux))
	t.Cleanup(srv.Close)
	client := srv.Client()

	return func(ctx context.Context, r adaptertest.Request) adaptertest.Reply {
		body, _ := json.Marshal(chargeRequest{Amount: r.Amount, Description: r.Behaviour})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/charges", bytes.NewReader(body))
		if r.Uncovered {
			req, err = http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/v1/charges/"+r.Behaviour, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+r.Tenant)
		if r.Key != "" {
			req.Header.Add(idemkey.KeyHeader, idemkey.FormatKey(r.Key))
			if r.KeyTwice {
				req.Header.Add(idemkey.KeyHeader, idemkey.FormatKey(r.Key))
			}
		}
		if r.FirstSent != "" {
			req.Header.Set(idemkey.FirstSentHeader, r.FirstSent)
		}
		if r.FirstRegion != "" {
			req.Header.Set(idemkey.FirstRegionHeader, r.FirstRegion)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Errorf("POST /v1/charges: %v", err)
			return adaptertest.Reply{}
		}
		defer resp.Body.Close()
		return readReply(t, resp)
	}
}

// readReply translates an HTTP response into the suite's terms.
func readReply(t *testing.T, resp *http.Response) adaptertest.Reply {
	t.Helper()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Errorf("read the body: %v", err)
	}
	reply := adaptertest.Reply{
		OK:       resp.StatusCode < 300,
		Status:   resp.StatusCode,
		Replayed: idemkey.ParseReplayed(resp.Header.Values(idemkey.ReplayedHeader)),
		Executed: idemkey.ParseExecuted(resp.Header.Values(idemkey.ReplayedHeader)),
		Ignored:  idemkey.ParseIgnored(resp.Header.Values(idemkey.StatusHeader)),
		Expires:  resp.Header.Get(idemkey.ExpiresHeader),
	}
	if s := resp.Header.Get("Retry-After"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Errorf("Retry-After %q: %v", s, err)
		}
		reply.RetryAfter = time.Duration(n) * time.Second
	}
	switch {
	case reply.OK:
		var c charge
		if err := json.Unmarshal(raw, &c); err != nil {
			t.Errorf("decode the charge %q: %v", raw, err)
		}
		reply.Body = c.ID
	case resp.Header.Get("Content-Type") == idemhttp.ProblemContentType:
		var p idemhttp.Problem
		if err := json.Unmarshal(raw, &p); err != nil {
			t.Errorf("decode the problem %q: %v", raw, err)
		}
		if p.Status != resp.StatusCode {
			t.Errorf("problem status %d in a response of status %d", p.Status, resp.StatusCode)
		}
		reply.Reason, reply.Body = idemhttp.ProblemReason(p.Type), p.Detail
	default:
		reply.Body = strings.TrimSpace(string(raw))
	}
	return reply
}
