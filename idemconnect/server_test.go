package idemconnect_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/logtest"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// A replay is the first reply whichever codec each call used: binary first
// and JSON after, and the reverse.
func TestReplayAcrossCodecs(t *testing.T) {
	runs := &counter{}
	url := serve(t, runs.handle, newInterceptor(t, single(t)))
	binary, json := newChargeClient(t, url), newChargeClient(t, url, connect.WithProtoJSON())
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR", Description: "tea"}
	for i, clients := range [][2]*connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge]{{binary, json}, {json, binary}} {
		key := []string{"proto-first", "json-first"}[i]
		first, err := call(t.Context(), clients[0], key, req)
		if err != nil {
			t.Fatal(err)
		}
		replay, err := call(t.Context(), clients[1], key, req)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(first.Msg, replay.Msg) || !idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)) || idemkey.ParseReplayed(first.Header().Values(idemkey.ReplayedHeader)) {
			t.Errorf("%s: first %v, replay %v (replayed %v); want the same message, only the replay marked", key, first.Msg, replay.Msg, idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)))
		}
	}
	runs.wantRuns(t, 2)
}

// blocker is a CreateCharge handler that waits for release.
type blocker struct {
	started chan struct{}
	release chan struct{}
}

func newBlocker() *blocker { return &blocker{make(chan struct{}, 4), make(chan struct{})} }

func (b *blocker) handle(ctx context.Context, req *chargeRequest) (*chargeResponse, error) {
	b.started <- struct{}{}
	select {
	case <-b.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return connect.NewResponse(&paymentsv1.Charge{Id: "ch_1", Amount: req.Msg.GetAmount()}), nil
}

// A duplicate during the first call is Aborted with Retry-After (whole
// seconds, rounded up) and the gRPC pushback; a plain HTTP client gets 409.
func TestInProgressRetryAfter(t *testing.T) {
	b := newBlocker()
	url := serve(t, b.handle, newInterceptor(t, single(t, engine.WithInProgressWait(0), engine.WithMaxRetryAfter(1500*time.Millisecond))))
	client := newChargeClient(t, url)
	req := &paymentsv1.CreateChargeRequest{Amount: 100}
	done := make(chan error, 1)
	go func() { _, err := call(t.Context(), client, "k1", req); done <- err }()
	<-b.started

	_, err := call(t.Context(), client, "k1", req)
	ce := new(connect.Error)
	if !asConnectError(err, &ce) || ce.Code() != connect.CodeAborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate: %v, want Aborted in progress", err)
	}
	// The lease of a call without a deadline is a minute, so the wait is the
	// maximum, 1.5s: Retry-After rounds it up.
	if got := ce.Meta().Get("Retry-After"); got != "2" {
		t.Errorf("Retry-After = %q, want 2", got)
	}
	if got := ce.Meta().Get("Grpc-Retry-Pushback-Ms"); got != "1500" {
		t.Errorf("pushback = %q, want 1500", got)
	}
	if d, ok := idemkey.RetryDelay(err); !ok || d != 1500*time.Millisecond {
		t.Errorf("RetryDelay = %v, %v; want 1.5s", d, ok)
	}

	// curl's view: the Connect protocol over plain HTTP with JSON.
	httpReq, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url+createCharge, strings.NewReader(`{"amount":"100"}`))
	httpReq.Header.Set("Content-Type", "application/json")
	httpReq.Header.Set("Idempotency-Key", "k1")
	resp, err := http.DefaultClient.Do(httpReq)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict || resp.Header.Get("Retry-After") != "2" ||
		!bytes.Contains(body, []byte(`"code":"aborted"`)) || !bytes.Contains(body, []byte(idemkey.ReasonInProgress)) {
		t.Errorf("plain HTTP duplicate: %d, Retry-After %q, body %s; want 409, 2, aborted in progress",
			resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}

	close(b.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	replay, err := call(t.Context(), client, "k1", req)
	if err != nil || !idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)) {
		t.Fatalf("after the first call: %v, %v; want the replay", replay, err)
	}
}

func asConnectError(err error, target **connect.Error) bool {
	ce, ok := err.(*connect.Error)
	if ok {
		*target = ce
	}
	return ok
}

// Allow-listed headers and trailers the handler sets, binary ones too,
// replay with the outcome, whichever way the handler set them; others do
// not.
func TestReplayedHeaders(t *testing.T) {
	handle := func(ctx context.Context, req *chargeRequest) (*chargeResponse, error) {
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Via-Context", "ctx")
		resp := connect.NewResponse(&paymentsv1.Charge{Id: "ch_1"})
		resp.Header().Set("X-Charge-Version", "3")
		resp.Header().Set("X-Secret", "not replayed")
		resp.Header().Set("X-Sig-Bin", connect.EncodeBinaryHeader([]byte{0, 1, 2}))
		resp.Trailer().Set("X-Ledger", "L1")
		return resp, nil
	}
	url := serve(t, handle, newInterceptor(t, single(t), idemconnect.WithReplayedHeaders("x-charge-version", "X-Via-Context", "x-sig-bin", "x-ledger")))
	for _, opts := range [][]connect.ClientOption{nil, {connect.WithGRPC()}} {
		client := newChargeClient(t, url, opts...)
		key := idemkey.NewKey()
		if _, err := call(t.Context(), client, key, &paymentsv1.CreateChargeRequest{}); err != nil {
			t.Fatal(err)
		}
		replay, err := call(t.Context(), client, key, &paymentsv1.CreateChargeRequest{})
		if err != nil {
			t.Fatal(err)
		}
		h, tr := replay.Header(), replay.Trailer()
		if h.Get("X-Charge-Version") != "3" || h.Get("X-Via-Context") != "ctx" || h.Get("X-Secret") != "" ||
			h.Get("X-Sig-Bin") != connect.EncodeBinaryHeader([]byte{0, 1, 2}) || tr.Get("X-Ledger") != "L1" {
			t.Errorf("%v: replay header %v, trailer %v", opts, h, tr)
		}
		grpc := len(opts) > 0
		if !idemkey.ParseReplayed(h.Values(idemkey.ReplayedHeader)) || idemkey.ParseReplayed(tr.Values(idemkey.ReplayedHeader)) != grpc {
			t.Errorf("%v: replay header %v, trailer %v: want the marker in the header, and in the trailer only over gRPC", opts, h, tr)
		}
	}
}

// Option mistakes are errors at construction, and so is an engine that
// cannot serve: none, or one that cannot tell tenants apart.
func TestOptionErrors(t *testing.T) {
	st := memory.New()
	eng := newEngine(t, st, engine.WithSingleTenant())
	for name, opts := range map[string][]idemconnect.Option{
		"unknown procedure":    {idemconnect.WithIncludedProcedures("CreateCharge")},
		"unknown excluded":     {idemconnect.WithExcludedProcedures("/x.Y/Z")},
		"atomic on memory":     {idemconnect.WithAtomic()},
		"atomic procedure":     {idemconnect.WithAtomicProcedures(createCharge)},
		"atomic but uncovered": {idemconnect.WithAtomicProcedures(getCharge)},
	} {
		if _, err := idemconnect.NewServerInterceptor(eng, opts...); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := idemconnect.NewServerInterceptor(nil); err == nil || !strings.Contains(err.Error(), "engine.New") {
		t.Errorf("nil engine: %v; want an error that says how to build one", err)
	}
	if _, err := idemconnect.NewServerInterceptor(newEngine(t, st)); err == nil ||
		!strings.Contains(err.Error(), "WithTenant") || !strings.Contains(err.Error(), "WithSingleTenant") {
		t.Errorf("an engine with neither WithTenant nor WithSingleTenant: %v; want an error naming both", err)
	}
	if _, err := idemconnect.NewServerInterceptor(eng, idemconnect.WithIncludedProcedures(getCharge)); err != nil {
		t.Errorf("a known procedure: %v", err)
	}
}

// The TenantFunc's refusal reaches the caller unchanged, and the handler
// does not run.
func TestTenantRefusal(t *testing.T) {
	runs := &counter{}
	refusal := connect.NewError(connect.CodePermissionDenied, errors.New("account suspended"))
	refusal.Meta().Set("X-Account-State", "suspended")
	tenant := func(ctx context.Context) (string, error) {
		if _, err := bearerTenant(ctx); err != nil {
			return "", err
		}
		return "", refusal
	}
	client := newChargeClient(t, serve(t, runs.handle, newInterceptor(t, newEngine(t, memory.New(), engine.WithTenant(tenant)))))
	req := &paymentsv1.CreateChargeRequest{Amount: 100}
	_, err := call(t.Context(), client, "k1", req)
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodePermissionDenied || ce.Message() != "account suspended" ||
		ce.Meta().Get("X-Account-State") != "suspended" || idemkey.Reason(err) != "" {
		t.Errorf("got %v, want the TenantFunc's PermissionDenied, whole", err)
	}
	// bearerTenant's own, for a call without credentials.
	noAuth := connect.NewRequest(req)
	noAuth.Header().Set(idemkey.KeyHeader, "k2")
	if _, err := client.CallUnary(t.Context(), noAuth); connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "no tenant") {
		t.Errorf("got %v, want bearerTenant's Unauthenticated", err)
	}
	runs.wantRuns(t, 0)
}

// A FingerprintFunc's *connect.Error reaches the caller as it is; any other
// error is Internal, logged by its type alone: its words may quote the
// request. The handler runs for neither.
func TestFingerprintErrors(t *testing.T) {
	logger, logs := logtest.New()
	runs := &counter{}
	fingerprint := func(_ string, req proto.Message) (store.Fingerprint, error) {
		desc := req.(*paymentsv1.CreateChargeRequest).GetDescription()
		if desc == "refuse" {
			return store.Fingerprint{}, connect.NewError(connect.CodeInvalidArgument, errors.New("amount missing"))
		}
		return store.Fingerprint{}, errors.New("cannot hash " + desc)
	}
	client := newChargeClient(t, serve(t, runs.handle, newInterceptor(t, single(t, engine.WithLogger(logger)), idemconnect.WithFingerprint(fingerprint))))
	_, err := call(t.Context(), client, "k1", &paymentsv1.CreateChargeRequest{Description: "refuse"})
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "amount missing") {
		t.Errorf("got %v, want the FingerprintFunc's InvalidArgument", err)
	}
	_, err = call(t.Context(), client, "k2", &paymentsv1.CreateChargeRequest{Description: "card 4242"})
	if connect.CodeOf(err) != connect.CodeInternal || strings.Contains(err.Error(), "4242") {
		t.Errorf("got %v, want Internal, not quoting the request", err)
	}
	if !strings.Contains(logs.String(), "fingerprint failed") || !strings.Contains(logs.String(), "*errors.errorString") {
		t.Errorf("the log does not say what failed:\n%s", logs)
	}
	if strings.Contains(logs.String(), "4242") {
		t.Errorf("the log quotes the FingerprintFunc's error:\n%s", logs)
	}
	runs.wantRuns(t, 0)
}

// A handler that panics leaves its key free: a retry runs it again.
func TestPanicReleasesKey(t *testing.T) {
	runs := &counter{}
	handle := func(ctx context.Context, req *chargeRequest) (*chargeResponse, error) {
		if runs.runs.Load() == 0 {
			runs.runs.Add(1)
			panic("boom")
		}
		return runs.handle(ctx, req)
	}
	mux := http.NewServeMux()
	// WithRecover is an interceptor: given first, it is outside idemkey's,
	// which sees the panic.
	mux.Handle(createCharge, connect.NewUnaryHandler(createCharge, handle,
		connect.WithRecover(func(context.Context, connect.Spec, http.Header, any) error {
			return connect.NewError(connect.CodeInternal, errors.New("panicked"))
		}),
		connect.WithInterceptors(newInterceptor(t, single(t)))))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	client := connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](srv.Client(), srv.URL+createCharge)
	req := &paymentsv1.CreateChargeRequest{Amount: 100}
	if _, err := call(t.Context(), client, "k1", req); connect.CodeOf(err) != connect.CodeInternal {
		t.Fatalf("first call: %v; want the recovered panic", err)
	}
	resp, err := call(t.Context(), client, "k1", req)
	if err != nil || idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)) {
		t.Fatalf("retry: %v, %v; want a fresh run", resp, err)
	}
	runs.wantRuns(t, 2)
}

// TestProcedureRetention: a procedure's own retention
// (WithProcedureRetention) is its keys' expiry; the interceptor refuses one
// for a procedure it does not cover, or shorter than the longest lease.
func TestProcedureRetention(t *testing.T) {
	const month = 31 * 24 * time.Hour
	runs := &counter{}
	url := serve(t, runs.handle, newInterceptor(t, single(t), idemconnect.WithProcedureRetention(month, createCharge)))
	before := time.Now().Truncate(time.Second)
	resp, err := call(t.Context(), newChargeClient(t, url), "key-1", &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	expires, ok := idemkey.ParseExpires(resp.Header().Values(idemkey.ExpiresHeader))
	if !ok {
		expires, ok = idemkey.ParseExpires(resp.Trailer().Values(idemkey.ExpiresHeader))
	}
	if !ok || expires.Before(before.Add(month)) || expires.After(time.Now().Add(month)) {
		t.Fatalf("expiry %v (%v), want a month from now", expires, ok)
	}
	for name, opt := range map[string]idemconnect.Option{
		"unknown":   idemconnect.WithProcedureRetention(month, "CreateCharge"),
		"too short": idemconnect.WithProcedureRetention(time.Second, createCharge),
	} {
		if _, err := idemconnect.NewServerInterceptor(single(t), opt); err == nil || !strings.Contains(err.Error(), "WithProcedureRetention") {
			t.Errorf("%s: %v, want a refusal naming WithProcedureRetention", name, err)
		}
	}
}
