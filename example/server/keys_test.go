package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
)

// createChargeOp is the operation CreateCharge's keys are kept under, over
// every entry point: POST /v1/charges is the gateway's call of it.
const createChargeOp = paymentsv1.PaymentService_CreateCharge_FullMethodName

// keyServer is a server with -http-addr, asked for its keys' states.
type keyServer struct {
	*servertest.Server
	http string // base URL of the HTTP address
}

// startKeyServer starts bin with args and an HTTP address, and waits until
// it serves both.
func startKeyServer(t *testing.T, bin string, args ...string) *keyServer {
	t.Helper()
	addrFile := filepath.Join(t.TempDir(), "http-addr")
	s := servertest.Start(t, bin, append(args, "-http-addr", "127.0.0.1:0", "-http-addr-file", addrFile)...)
	var addr []byte
	waitFor(t, 30*time.Second, "the HTTP address file is written", func() bool {
		addr, _ = os.ReadFile(addrFile)
		return len(addr) > 0
	})
	return &keyServer{Server: s, http: "http://" + strings.TrimSpace(string(addr))}
}

// getKey asks GetKey over gRPC, as apiKey's tenant, for key sent to
// CreateCharge, first sent at firstSent (none if zero).
func (s *keyServer) getKey(t *testing.T, apiKey, key string, firstSent time.Time) (*idemkeyv1.GetKeyResponse, metadata.MD) {
	t.Helper()
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+apiKey)
	if !firstSent.IsZero() {
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, idemkey.FormatDate(firstSent))
	}
	resp := new(idemkeyv1.GetKeyResponse)
	var trailer metadata.MD
	if err := s.Conn.Invoke(ctx, "/idemkey.v1.KeyService/GetKey", &idemkeyv1.GetKeyRequest{Operation: createChargeOp, Key: key}, resp, grpc.Trailer(&trailer)); err != nil {
		t.Fatalf("GetKey over gRPC: %v", err)
	}
	return resp, trailer
}

// getKeyConnect asks GetKey over the Connect protocol, as acme.
func (s *keyServer) getKeyConnect(t *testing.T, key string) *idemkeyv1.GetKeyResponse {
	t.Helper()
	client := connect.NewClient[idemkeyv1.GetKeyRequest, idemkeyv1.GetKeyResponse](http.DefaultClient, s.http+"/idemkey.v1.KeyService/GetKey")
	req := connect.NewRequest(&idemkeyv1.GetKeyRequest{Operation: createChargeOp, Key: key})
	req.Header().Set("Authorization", "Bearer sk_test_acme")
	resp, err := client.CallUnary(t.Context(), req)
	if err != nil {
		t.Fatalf("GetKey over Connect: %v", err)
	}
	return resp.Msg
}

// keyAnswer is an answer of GET /v1/idempotency-keys/{key}.
type keyAnswer struct {
	code   int
	header http.Header
	body   []byte
	state  struct {
		State      string   `json:"state"`
		RetryAfter int64    `json:"retry_after"`
		StepsDone  []string `json:"steps_done"`
		Expires    string   `json:"expires"`
	}
}

// getKeyHTTP asks GET /v1/idempotency-keys/{key}?operation=CreateCharge as
// curl would, as apiKey's tenant, first sent at firstSent (none if zero).
func (s *keyServer) getKeyHTTP(t *testing.T, apiKey, key string, firstSent time.Time) *keyAnswer {
	t.Helper()
	u := s.http + "/v1/idempotency-keys/" + url.PathEscape(key) + "?" + url.Values{"operation": {createChargeOp}}.Encode()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+apiKey)
	if !firstSent.IsZero() {
		req.Header.Set(idemkey.FirstSentHeader, idemkey.FormatDate(firstSent))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	a := &keyAnswer{code: resp.StatusCode, header: resp.Header}
	a.body, _ = io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(a.body, &a.state); err != nil {
			t.Fatalf("GET %s: %d %s: %v", u, resp.StatusCode, a.body, err)
		}
	}
	return a
}

// wantState fails t unless a over HTTP is the 200 JSON of state.
func (a *keyAnswer) wantState(t *testing.T, who, state string) {
	t.Helper()
	if a.code != http.StatusOK || a.state.State != state || a.header.Get(idemkey.ReplayedHeader) != "" {
		t.Errorf("%s over HTTP: %d %s (replayed %q), want 200 state %s, no replay marker", who, a.code, a.body, a.header.Get(idemkey.ReplayedHeader), state)
	}
}

// A key's state, asked without its request over gRPC, Connect and HTTP, on
// each store and mode (memory, Redis, and PostgreSQL, Spanner and three
// PostgreSQL shards in both modes): unknown for a key never sent, in
// progress (with a wait) while CreateCharge holds it, completed with the
// reply a retry of CreateCharge gets, and expired for a key with no record
// first sent longer ago than the retention. Another tenant asking the same
// key is told unknown.
func TestKeyState(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{memoryStore, postgresTwoPhase, postgresAtomic, redisStore, spannerAtomic, spannerTwoPhase, shardsAtomic, shardsTwoPhase} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			// The held call holds its key for -handler-delay, which leaves a
			// busy machine time to ask twice while it runs.
			const hold = 5 * time.Second
			s := startKeyServer(t, bin, append(st.args(t), "-handler-delay", hold.String())...)

			never := idemkey.NewKey()
			if resp, _ := s.getKey(t, "sk_test_acme", never, time.Time{}); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN || resp.GetExpireTime() != nil {
				t.Errorf("a key never sent over gRPC: %v, want unknown with no expiry", resp)
			}
			s.getKeyHTTP(t, "sk_test_acme", never, time.Time{}).wantState(t, "a key never sent", "unknown")

			// 25h ago, the default retention (24h) and its skew behind.
			long := time.Now().Add(-25 * time.Hour)
			if resp, _ := s.getKey(t, "sk_test_acme", never, long); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_EXPIRED {
				t.Errorf("a key with no record first sent 25h ago over gRPC: %v, want expired", resp)
			}
			s.getKeyHTTP(t, "sk_test_acme", never, long).wantState(t, "a key with no record first sent 25h ago", "expired")
			if resp, _ := s.getKey(t, "sk_test_acme", never, time.Now().Add(-time.Minute)); resp.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
				t.Errorf("a key with no record first sent a minute ago over gRPC: %v, want unknown", resp)
			}

			key := idemkey.NewKey()
			type result struct {
				charge *paymentsv1.Charge
				err    error
			}
			first := make(chan result, 1)
			go func() {
				charge, _, err := create(s.Server, key, acmeRequest)
				first <- result{charge, err}
			}()
			// The call is held after the processor's charge, its step.
			var held *idemkeyv1.GetKeyResponse
			waitFor(t, 30*time.Second, "GetKey tells the held call's step done", func() bool {
				held, _ = s.getKey(t, "sk_test_acme", key, time.Time{})
				return (held.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN && held.GetState() != idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS) ||
					slices.Equal(held.GetStepsDone(), []string{chargeStep})
			})
			switch {
			case held.GetState() != idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS || held.GetRetryAfter().AsDuration() <= 0:
				t.Errorf("the held call's key over gRPC: %v, want in progress with a wait, its step done", held)
			case st.lockHeld && held.GetExpireTime() != nil:
				t.Errorf("the held atomic call's key over gRPC: %v, want no expiry: its lock tells none", held)
			case !st.lockHeld && held.GetExpireTime() == nil:
				t.Errorf("the held call's key over gRPC: %v, want its expiry", held)
			}
			a := s.getKeyHTTP(t, "sk_test_acme", key, time.Time{})
			a.wantState(t, "the held call's key", "in_progress")
			if !slices.Equal(a.state.StepsDone, []string{chargeStep}) {
				t.Errorf("the held call's key over HTTP: steps_done %q, want [%s]", a.state.StepsDone, chargeStep)
			}
			if n, err := strconv.Atoi(a.header.Get("Retry-After")); err != nil || n <= 0 || int64(n) != a.state.RetryAfter {
				t.Errorf("the held call's key over HTTP: Retry-After %q, retry_after %d; want the same wait, at least 1s", a.header.Get("Retry-After"), a.state.RetryAfter)
			}
			if other, _ := s.getKey(t, "sk_test_globex", key, time.Time{}); other.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
				t.Errorf("the held key asked by another tenant over gRPC: %v, want unknown", other)
			}

			var want *paymentsv1.Charge
			select {
			case r := <-first:
				if r.err != nil {
					t.Fatalf("the held call: %v", r.err)
				}
				want = r.charge
			case <-time.After(hold + time.Minute):
				t.Fatal("the held call did not end")
			}
			if want.GetProcessorChargeId() == "" {
				t.Fatalf("the charge %v has no processor_charge_id", want)
			}
			retry, trailer, err := create(s.Server, key, acmeRequest)
			if err != nil || !proto.Equal(retry, want) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Fatalf("a retry of CreateCharge: %v, %v (replayed %v); want the first reply, replayed", retry, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}

			done, trailer := s.getKey(t, "sk_test_acme", key, time.Time{})
			got := &paymentsv1.Charge{}
			if done.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || done.GetStatus().GetCode() != 0 || done.GetResponse().UnmarshalTo(got) != nil || !proto.Equal(got, retry) {
				t.Errorf("the completed key over gRPC: %v, want completed with the reply a retry gets, %v", done, retry)
			}
			if _, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata)); !ok || done.GetExpireTime() == nil {
				t.Errorf("the completed key over gRPC: expire_time %v, trailer %v; want its expiry in both", done.GetExpireTime(), trailer)
			}
			got = &paymentsv1.Charge{}
			if c := s.getKeyConnect(t, key); c.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || c.GetResponse().UnmarshalTo(got) != nil || !proto.Equal(got, retry) {
				t.Errorf("the completed key over Connect: %v, want completed with the reply a retry gets, %v", c, retry)
			}

			// Over HTTP, as a retry of POST /v1/charges gets it.
			e := &entryPoints{http: s.http}
			code, httpRetry, _, header := e.viaHTTP(t, key, jsonOf(t, acmeRequest))
			if code != http.StatusCreated || !proto.Equal(httpRetry, want) || !idemkey.ParseReplayed(header.Values(idemkey.ReplayedHeader)) {
				t.Fatalf("a retry of POST /v1/charges: %d %v (replayed %q), want 201 with the first reply, replayed", code, httpRetry, header.Get(idemkey.ReplayedHeader))
			}
			a = s.getKeyHTTP(t, "sk_test_acme", key, time.Time{})
			got = &paymentsv1.Charge{}
			if err := protojson.Unmarshal(a.body, got); a.code != http.StatusCreated || err != nil || !proto.Equal(got, httpRetry) {
				t.Errorf("the completed key over HTTP: %d %s, want 201 with the charge a retry gets, %v", a.code, a.body, httpRetry)
			}
			for _, h := range []string{idemkey.ReplayedHeader, "Location", "Content-Type", idemkey.ExpiresHeader} {
				if a.header.Get(h) != header.Get(h) || a.header.Get(h) == "" {
					t.Errorf("the completed key over HTTP: %s %q, want the retry's %q", h, a.header.Get(h), header.Get(h))
				}
			}

			if other, _ := s.getKey(t, "sk_test_globex", key, time.Time{}); other.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN || other.GetResponse() != nil {
				t.Errorf("acme's completed key asked by globex over gRPC: %v, want unknown", other)
			}
			other := s.getKeyHTTP(t, "sk_test_globex", key, time.Time{})
			other.wantState(t, "acme's completed key asked by globex", "unknown")
			if bytes.Contains(other.body, []byte(want.GetId())) {
				t.Errorf("globex was told acme's charge: %s", other.body)
			}
		})
	}
}

// A key's state is scoped as the calls are: a caller without a known API
// key is refused, and an operation whose keys are not kept (GetCharge, free
// of side effects) or a malformed key is refused, never answered unknown.
func TestKeyStateRefusals(t *testing.T) {
	s := startKeyServer(t, servertest.Build(t), "-database-url=")
	for _, tc := range []struct {
		name, auth, key, operation string
		want                       int
	}{
		{"no API key", "", idemkey.NewKey(), createChargeOp, http.StatusUnauthorized},
		{"an unknown API key", "Bearer sk_test_nobody", idemkey.NewKey(), createChargeOp, http.StatusUnauthorized},
		{"no operation", "Bearer sk_test_acme", idemkey.NewKey(), "", http.StatusBadRequest},
		{"GetCharge", "Bearer sk_test_acme", idemkey.NewKey(), paymentsv1.PaymentService_GetCharge_FullMethodName, http.StatusBadRequest},
		{"a malformed key", "Bearer sk_test_acme", strings.Repeat("k", 1000), createChargeOp, http.StatusBadRequest},
	} {
		u := s.http + "/v1/idempotency-keys/" + url.PathEscape(tc.key) + "?" + url.Values{"operation": {tc.operation}}.Encode()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, u, nil)
		if err != nil {
			t.Fatal(err)
		}
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want || resp.Header.Get("Content-Type") != "application/problem+json" || bytes.Contains(body, []byte(tc.key)) {
			t.Errorf("%s over HTTP: %d %s %s, want a %d problem that does not quote the key", tc.name, resp.StatusCode, resp.Header.Get("Content-Type"), body, tc.want)
		}
		ctx := t.Context()
		if tc.auth != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", tc.auth)
		}
		err = s.Conn.Invoke(ctx, "/idemkey.v1.KeyService/GetKey", &idemkeyv1.GetKeyRequest{Operation: tc.operation, Key: tc.key}, new(idemkeyv1.GetKeyResponse))
		if err == nil || strings.Contains(err.Error(), tc.key) {
			t.Errorf("%s over gRPC: %v, want a refusal that does not quote the key", tc.name, err)
		}
	}
}

// With -seal-key the reply recorded in PostgreSQL stays sealed, and GetKey
// answers it opened, over gRPC and HTTP, in both modes.
func TestKeyStateSealed(t *testing.T) {
	bin := servertest.Build(t)
	for _, atomic := range []string{"-atomic=true", "-atomic=false"} {
		t.Run(atomic, func(t *testing.T) {
			t.Parallel()
			schema := pgtest.Schema(t)
			sealKey, _ := keyFile(t, "seal.key")
			s := startKeyServer(t, bin, "-database-url", pgtest.SchemaURL(schema), atomic, "-seal-key", sealKey)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_sealed_bob", Amount: 4343, Currency: "EUR", Description: "card ending 4343"}
			want, _, err := create(s.Server, key, req)
			if err != nil {
				t.Fatal(err)
			}
			var outcome []byte
			if err := pgtest.Pool(t, schema).QueryRow(context.Background(), `SELECT outcome FROM idempotency_keys`).Scan(&outcome); err != nil {
				t.Fatal(err)
			}
			for _, plain := range []string{"cus_sealed_bob", "ending 4343", want.GetId(), want.GetProcessorChargeId()} {
				if bytes.Contains(outcome, []byte(plain)) {
					t.Fatalf("the table holds the reply in the clear (%q): %q", plain, outcome)
				}
			}
			resp, _ := s.getKey(t, "sk_test_acme", key, time.Time{})
			got := &paymentsv1.Charge{}
			if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED || resp.GetResponse().UnmarshalTo(got) != nil || !proto.Equal(got, want) {
				t.Errorf("the sealed key over gRPC: %v, want completed with the opened reply %v", resp, want)
			}
			a := s.getKeyHTTP(t, "sk_test_acme", key, time.Time{})
			got = &paymentsv1.Charge{}
			if err := protojson.Unmarshal(a.body, got); a.code != http.StatusCreated || err != nil || !proto.Equal(got, want) {
				t.Errorf("the sealed key over HTTP: %d %s, want 201 with the opened reply %v", a.code, a.body, want)
			}
			if other, _ := s.getKey(t, "sk_test_globex", key, time.Time{}); other.GetState() != idemkeyv1.GetKeyResponse_STATE_UNKNOWN {
				t.Errorf("the sealed key asked by globex: %v, want unknown", other)
			}
		})
	}
}
