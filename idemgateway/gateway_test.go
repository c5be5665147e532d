package idemgateway_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemgateway"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// charges is a PaymentService whose CreateCharge counts its runs and keeps
// the key each ran with, waits for release when the description says
// "slow", and fails NOT_FOUND for customer "cus_missing".
type charges struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs    atomic.Int64
	started chan struct{}
	release chan struct{}

	mu   sync.Mutex
	keys []string // the key of each run, "" for none
}

// ran counts a run with key, and returns how many there were.
func (c *charges) ran(key string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.keys = append(c.keys, key)
	return c.runs.Add(1)
}

// ranWith returns the key of each run so far.
func (c *charges) ranWith() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.keys)
}

// GetCharge finds ch_1 alone.
func (c *charges) GetCharge(_ context.Context, req *paymentsv1.GetChargeRequest) (*paymentsv1.Charge, error) {
	if req.GetId() != "ch_1" {
		return nil, status.Error(codes.NotFound, "no such charge")
	}
	return &paymentsv1.Charge{Id: "ch_1"}, nil
}

func (c *charges) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	key, _, _ := interceptor.KeyFromIncomingContext(ctx)
	n := c.ran(key)
	if req.GetDescription() == "slow" {
		c.started <- struct{}{}
		<-c.release
	}
	if req.GetCustomerId() == "cus_missing" {
		return nil, status.Error(codes.NotFound, "no such customer")
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-served-by", "charges"))
	return &paymentsv1.Charge{Id: "ch_" + string(rune('0'+n)), CustomerId: req.GetCustomerId(), Amount: req.GetAmount()}, nil
}

// gateway serves POST /v1/charges through a grpc-gateway ServeMux made
// with opts and the mux options, to CreateCharge over bufconn behind the
// interceptor on st.
func gateway(t *testing.T, st store.Store, svc *charges, opts []idemgateway.Option, muxOpts ...runtime.ServeMuxOption) string {
	t.Helper()
	return serveGateway(t, grpctest.Interceptor(st, engine.WithKeyRequired()), svc, append(idemgateway.ServeMuxOptions(opts...), muxOpts...)...)
}

// serveGateway serves POST /v1/charges through a grpc-gateway ServeMux made
// with muxOpts alone, to CreateCharge over bufconn behind ic, over HTTP/1.1
// and h2c.
func serveGateway(t *testing.T, ic grpc.UnaryServerInterceptor, svc *charges, muxOpts ...runtime.ServeMuxOption) string {
	t.Helper()
	srv := grpc.NewServer(grpc.UnaryInterceptor(ic))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	mux := runtime.NewServeMux(muxOpts...)
	// What protoc-gen-grpc-gateway generates for a POST with body "*".
	const method = "/example.payments.v1.PaymentService/CreateCharge"
	err := mux.HandlePath(http.MethodPost, "/v1/charges", func(w http.ResponseWriter, r *http.Request, _ map[string]string) {
		_, out := runtime.MarshalerForRequest(mux, r)
		ctx, err := runtime.AnnotateContext(r.Context(), mux, r, method, runtime.WithHTTPPathPattern("/v1/charges"))
		if err != nil {
			runtime.HTTPError(r.Context(), mux, out, w, r, err)
			return
		}
		req := &paymentsv1.CreateChargeRequest{}
		body, _ := io.ReadAll(r.Body)
		if err := protojson.Unmarshal(body, req); err != nil {
			runtime.HTTPError(ctx, mux, out, w, r, status.Error(codes.InvalidArgument, err.Error()))
			return
		}
		var md runtime.ServerMetadata
		resp, err := client.CreateCharge(ctx, req, grpc.Header(&md.HeaderMD), grpc.Trailer(&md.TrailerMD))
		ctx = runtime.NewServerMetadataContext(ctx, md)
		if err != nil {
			runtime.HTTPError(ctx, mux, out, w, r, err)
			return
		}
		runtime.ForwardResponseMessage(ctx, mux, out, w, r, resp, mux.GetForwardResponseOptions()...)
	})
	if err != nil {
		t.Fatal(err)
	}
	// GetCharge, which the interceptor does not cover (NO_SIDE_EFFECTS).
	err = mux.HandlePath(http.MethodGet, "/v1/charges/{id}", func(w http.ResponseWriter, r *http.Request, params map[string]string) {
		_, out := runtime.MarshalerForRequest(mux, r)
		ctx, err := runtime.AnnotateContext(r.Context(), mux, r, "/example.payments.v1.PaymentService/GetCharge", runtime.WithHTTPPathPattern("/v1/charges/{id}"))
		if err != nil {
			runtime.HTTPError(r.Context(), mux, out, w, r, err)
			return
		}
		var md runtime.ServerMetadata
		resp, err := client.GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: params["id"]}, grpc.Header(&md.HeaderMD), grpc.Trailer(&md.TrailerMD))
		ctx = runtime.NewServerMetadataContext(ctx, md)
		if err != nil {
			runtime.HTTPError(ctx, mux, out, w, r, err)
			return
		}
		runtime.ForwardResponseMessage(ctx, mux, out, w, r, resp, mux.GetForwardResponseOptions()...)
	})
	if err != nil {
		t.Fatal(err)
	}
	return serveHTTP(t, mux)
}

// serveHTTP serves h over HTTP/1.1 and h2c on loopback until t ends, and
// returns its URL.
func serveHTTP(t *testing.T, h http.Handler) string {
	hs := httptest.NewUnstartedServer(h)
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	return hs.URL
}

func newCharges() *charges {
	return &charges{started: make(chan struct{}, 4), release: make(chan struct{})}
}

// answer is what a client of the gateway sees.
type answer struct {
	status int
	header http.Header
	body   string
}

// post sends POST /v1/charges with body and the headers, in pairs.
func post(t *testing.T, url, body string, headers ...string) answer {
	t.Helper()
	return send(t, http.MethodPost, url+"/v1/charges", body, headers...)
}

func send(t *testing.T, method, url, body string, headers ...string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// reason is the idemkey reason of a problem answer, "" if it is none.
func (a answer) reason(t *testing.T) string {
	t.Helper()
	if a.header.Get("Content-Type") != idemhttp.ProblemContentType {
		return ""
	}
	var p idemhttp.Problem
	if err := json.Unmarshal([]byte(a.body), &p); err != nil {
		t.Fatalf("problem %q: %v", a.body, err)
	}
	if p.Status != a.status {
		t.Errorf("problem status %d, answered %d", p.Status, a.status)
	}
	return idemhttp.ProblemReason(p.Type)
}

const charge = `{"customerId":"cus_1","amount":100,"currency":"EUR"}`

// A key sent bare, then quoted as draft-07's sf-string, is one key: the
// retry is the first reply, marked replayed, with the same expiry, and the
// handler ran once.
func TestRetryThroughGatewayReplays(t *testing.T) {
	svc := newCharges()
	url := gateway(t, memory.New(), svc, nil)
	first := post(t, url, charge, idemkey.KeyHeader, "order-1001")
	retry := post(t, url, charge, idemkey.KeyHeader, `"order-1001"`)
	if first.status != http.StatusOK || retry.status != http.StatusOK || first.body != retry.body {
		t.Fatalf("first %d %s, retry %d %s; want 200 and the same body", first.status, first.body, retry.status, retry.body)
	}
	if first.header.Get(idemkey.ReplayedHeader) != "false" || retry.header.Get(idemkey.ReplayedHeader) != "true" {
		t.Errorf("%s: first %q, retry %q; want the first marked false, the retry true", idemkey.ReplayedHeader,
			first.header.Get(idemkey.ReplayedHeader), retry.header.Get(idemkey.ReplayedHeader))
	}
	exp := first.header.Get(idemkey.ExpiresHeader)
	if _, err := idemkey.ParseDate(exp); err != nil || retry.header.Get(idemkey.ExpiresHeader) != exp {
		t.Errorf("%s: first %q, retry %q; want one HTTP date on both", idemkey.ExpiresHeader, exp, retry.header.Get(idemkey.ExpiresHeader))
	}
	if got := first.header.Get("Grpc-Metadata-X-Served-By"); got != "charges" {
		t.Errorf("the handler's own header metadata: %q; want it forwarded as grpc-gateway does", got)
	}
	if n := svc.runs.Load(); n != 1 {
		t.Errorf("CreateCharge ran %d times; want 1", n)
	}
}

// Each of idemkey's refusals is answered at the draft's status, as an RFC
// 9457 problem with idemkey's reason, and nothing ran that should not.
func TestDraftStatuses(t *testing.T) {
	svc := newCharges()
	url := gateway(t, memory.New(memory.WithMaxRecords(3)), svc, nil)
	stale := idemkey.FormatDate(time.Now().Add(-30 * 24 * time.Hour))
	cases := []struct {
		name    string
		body    string
		headers []string
		status  int
		reason  string
	}{
		{"missing", charge, nil, http.StatusBadRequest, idemkey.ReasonKeyMissing},
		{"malformed", charge, []string{idemkey.KeyHeader, `"unterminated`}, http.StatusBadRequest, idemkey.ReasonKeyInvalid},
		{"sent twice", charge, []string{idemkey.KeyHeader, "order-1", idemkey.KeyHeader, "order-2"}, http.StatusBadRequest, idemkey.ReasonKeyInvalid},
		{"first-sent malformed", charge, []string{idemkey.KeyHeader, "order-3", idemkey.FirstSentHeader, "yesterday"}, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid},
		{"first-sent stale", charge, []string{idemkey.KeyHeader, "order-4", idemkey.FirstSentHeader, stale}, http.StatusPreconditionFailed, idemkey.ReasonKeyExpired},
		{"first use", charge, []string{idemkey.KeyHeader, "order-5"}, http.StatusOK, ""},
		{"reused", `{"customerId":"cus_1","amount":999}`, []string{idemkey.KeyHeader, "order-5"}, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused},
	}
	for _, c := range cases {
		a := post(t, url, c.body, c.headers...)
		if a.status != c.status || a.reason(t) != c.reason {
			t.Errorf("%s: %d %q (%s); want %d %q", c.name, a.status, a.reason(t), a.body, c.status, c.reason)
		}
	}
	if n := svc.runs.Load(); n != 1 {
		t.Errorf("CreateCharge ran %d times; want once, for the first use", n)
	}
	// The store holds order-5 and room for two more keys.
	post(t, url, charge, idemkey.KeyHeader, "order-6")
	post(t, url, charge, idemkey.KeyHeader, "order-7")
	full := post(t, url, charge, idemkey.KeyHeader, "order-8")
	if full.status != http.StatusServiceUnavailable || full.reason(t) != idemkey.ReasonStoreFull || full.header.Get("Retry-After") == "" {
		t.Errorf("a full store: %d %q, Retry-After %q; want 503 %q with Retry-After", full.status, full.reason(t),
			full.header.Get("Retry-After"), idemkey.ReasonStoreFull)
	}
}

// A store that fails is 503 IDEMPOTENCY_STORE_UNAVAILABLE, and the handler
// did not run: a PostgreSQL store whose pool is closed.
func TestStoreUnavailable(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	svc := newCharges()
	url := gateway(t, st, svc, nil)
	pool.Close()
	a := post(t, url, charge, idemkey.KeyHeader, "order-down")
	if a.status != http.StatusServiceUnavailable || a.reason(t) != idemkey.ReasonStoreUnavailable {
		t.Errorf("a failed store: %d %q (%s); want 503 %q", a.status, a.reason(t), a.body, idemkey.ReasonStoreUnavailable)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Errorf("CreateCharge ran %d times; want 0", n)
	}
}

// A retry while the first call runs is 409 with Retry-After, and the
// handler ran once.
func TestInProgressRetryAfter(t *testing.T) {
	svc := newCharges()
	url := gateway(t, memory.New(), svc, nil)
	slow := `{"customerId":"cus_1","amount":100,"description":"slow"}`
	done := make(chan answer, 1)
	go func() { done <- post(t, url, slow, idemkey.KeyHeader, "order-slow") }()
	<-svc.started
	a := post(t, url, slow, idemkey.KeyHeader, "order-slow")
	close(svc.release)
	if a.status != http.StatusConflict || a.reason(t) != idemkey.ReasonInProgress || a.header.Get("Retry-After") == "" {
		t.Errorf("a retry in progress: %d %q, Retry-After %q; want 409 %q with Retry-After", a.status, a.reason(t),
			a.header.Get("Retry-After"), idemkey.ReasonInProgress)
	}
	if first := <-done; first.status != http.StatusOK {
		t.Errorf("the first call: %d %s", first.status, first.body)
	}
	if n := svc.runs.Load(); n != 1 {
		t.Errorf("CreateCharge ran %d times; want 1", n)
	}
}

// The application's own matcher and error handler, given as options, see
// every header and error that are not idemkey's; a recorded failure's
// replay, which the application's handler answers, is still marked.
func TestApplicationMatcherAndErrorHandler(t *testing.T) {
	svc := newCharges()
	var handled atomic.Int64
	url := gateway(t, memory.New(), svc, []idemgateway.Option{
		idemgateway.WithHeaderMatcher(func(key string) (string, bool) {
			if key == "X-Request-Source" {
				return "x-request-source", true
			}
			return runtime.DefaultHeaderMatcher(key)
		}),
		idemgateway.WithErrorHandler(func(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
			handled.Add(1)
			runtime.DefaultHTTPErrorHandler(ctx, mux, m, w, r, err)
		}),
	})
	missing := `{"customerId":"cus_missing","amount":100}`
	first := post(t, url, missing, idemkey.KeyHeader, "order-404", "X-Request-Source", "test")
	retry := post(t, url, missing, idemkey.KeyHeader, "order-404")
	if first.status != http.StatusNotFound || retry.status != http.StatusNotFound || first.body != retry.body {
		t.Fatalf("first %d %s, retry %d %s; want grpc-gateway's 404 twice", first.status, first.body, retry.status, retry.body)
	}
	if retry.header.Get(idemkey.ReplayedHeader) != "true" || first.header.Get(idemkey.ReplayedHeader) != "false" {
		t.Errorf("replayed: first %q, retry %q; want the recorded NOT_FOUND's retry marked", first.header.Get(idemkey.ReplayedHeader), retry.header.Get(idemkey.ReplayedHeader))
	}
	if n := handled.Load(); n != 2 {
		t.Errorf("the application's error handler ran %d times; want 2", n)
	}
	if a := post(t, url, charge); a.status != http.StatusBadRequest || a.reason(t) != idemkey.ReasonKeyMissing || handled.Load() != 2 {
		t.Errorf("a missing key: %d %q, application handler %d; want idemkey's 400, not the application's", a.status, a.reason(t), handled.Load())
	}
	if n := svc.runs.Load(); n != 1 {
		t.Errorf("CreateCharge ran %d times; want 1", n)
	}
}

// Options of nil keep the defaults rather than leaving the mux without a
// matcher or an error handler.
func TestNilOptionsKeepDefaults(t *testing.T) {
	url := gateway(t, memory.New(), newCharges(), []idemgateway.Option{idemgateway.WithHeaderMatcher(nil), idemgateway.WithErrorHandler(nil)})
	if a := post(t, url, `{"customerId":"cus_missing"}`, idemkey.KeyHeader, "k1"); a.status != http.StatusNotFound {
		t.Errorf("%d %s; want grpc-gateway's default 404", a.status, a.body)
	}
	if a := post(t, url, charge, "Authorization", "Bearer x"); a.reason(t) != idemkey.ReasonKeyMissing {
		t.Errorf("%d %s; want the key missing", a.status, a.body)
	}
}

// A key sent to GetCharge, which the interceptor does not cover, is answered
// as ignored, a reply and an error alike; a first execution and a replay
// are never so marked.
func TestUncoveredKeyIsIgnored(t *testing.T) {
	svc := newCharges()
	url := gateway(t, memory.New(), svc, nil)
	for _, tc := range []struct {
		id     string
		status int
	}{{"ch_1", http.StatusOK}, {"ch_2", http.StatusNotFound}} {
		got := send(t, http.MethodGet, url+"/v1/charges/"+tc.id, "", idemkey.KeyHeader, "order-1")
		if got.status != tc.status || !idemkey.ParseIgnored(got.header.Values(idemkey.StatusHeader)) || got.header.Get(idemkey.ReplayedHeader) != "" {
			t.Errorf("GET %s with a key: %d %v; want %d marked %s: %s alone", tc.id, got.status, got.header, tc.status, idemkey.StatusHeader, idemkey.StatusIgnored)
		}
	}
	if got := send(t, http.MethodGet, url+"/v1/charges/ch_1", ""); got.header.Get(idemkey.StatusHeader) != "" {
		t.Errorf("GET without a key: %v, want no %s", got.header, idemkey.StatusHeader)
	}
	for range 2 {
		if got := post(t, url, charge, idemkey.KeyHeader, "order-2"); got.header.Get(idemkey.StatusHeader) != "" {
			t.Errorf("POST: %v, want no %s", got.header, idemkey.StatusHeader)
		}
	}
}
