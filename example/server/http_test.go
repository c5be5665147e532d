package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// entryPoints is one server with -http-addr, and a client of each of its
// three entry points for CreateCharge.
type entryPoints struct {
	grpc    paymentsv1.PaymentServiceClient
	connect paymentsv1connect.PaymentServiceClient
	http    string // base URL of the HTTP address
}

func startEntryPoints(t *testing.T, cfg config) *entryPoints {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.httpAddr, cfg.httpAddrFile, cfg.ttl = "127.0.0.1:0", filepath.Join(t.TempDir(), "http-addr"), time.Hour
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, lis, cfg, slog.New(slog.DiscardHandler)) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	})
	var addr []byte
	waitUntil(t, "the HTTP address file is written", func() bool {
		addr, _ = os.ReadFile(cfg.httpAddrFile)
		return len(addr) > 0
	})
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	base := "http://" + strings.TrimSpace(string(addr))
	return &entryPoints{
		grpc:    paymentsv1.NewPaymentServiceClient(conn),
		connect: paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, base, connect.WithProtoJSON()),
		http:    base,
	}
}

// viaGRPC sends CreateCharge as grpcurl would, with the key in the metadata
// (none if "").
func (e *entryPoints) viaGRPC(t *testing.T, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
	t.Helper()
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer sk_test_acme")
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
	}
	var trailer metadata.MD
	charge, err := e.grpc.CreateCharge(ctx, req, grpc.Trailer(&trailer))
	return charge, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), err
}

// viaConnect sends CreateCharge over the Connect protocol, in JSON.
func (e *entryPoints) viaConnect(t *testing.T, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
	t.Helper()
	r := connect.NewRequest(req)
	r.Header().Set("Authorization", "Bearer sk_test_acme")
	if key != "" {
		r.Header().Set(idemkey.KeyHeader, key)
	}
	resp, err := e.connect.CreateCharge(t.Context(), r)
	if err != nil {
		return nil, false, err
	}
	return resp.Msg, idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)), nil
}

// viaHTTP sends POST /v1/charges as curl would, with the headers (in pairs,
// an empty value sends none); it returns the status, the charge of a 201,
// the problem of any other, and its headers.
func (e *entryPoints) viaHTTP(t *testing.T, key string, body string, headers ...string) (int, *paymentsv1.Charge, idemhttp.Problem, http.Header) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.http+"/v1/charges", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer sk_test_acme")
	if key != "" {
		req.Header.Set(idemkey.KeyHeader, key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i+1] != "" {
			req.Header.Add(headers[i], headers[i+1])
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var problem idemhttp.Problem
	if resp.StatusCode != http.StatusCreated {
		if ct := resp.Header.Get("Content-Type"); ct != idemhttp.ProblemContentType {
			t.Fatalf("status %d with Content-Type %q, want a problem: %s", resp.StatusCode, ct, raw)
		}
		if err := json.Unmarshal(raw, &problem); err != nil {
			t.Fatalf("problem %s: %v", raw, err)
		}
		return resp.StatusCode, nil, problem, resp.Header
	}
	charge := &paymentsv1.Charge{}
	if err := protojson.Unmarshal(raw, charge); err != nil {
		t.Fatalf("charge %s: %v", raw, err)
	}
	return resp.StatusCode, charge, problem, resp.Header
}

func jsonOf(t *testing.T, req *paymentsv1.CreateChargeRequest) string {
	b, err := protojson.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The three entry points share one scope: a key first used over any of them
// replays the same charge over the others for the same request, and is
// refused as reused for another; on memory, and on PostgreSQL in both modes.
func TestEntryPointsShareKeys(t *testing.T) {
	for name, cfg := range storeConfigs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := startEntryPoints(t, cfg(t))
			req := func(amount int64) *paymentsv1.CreateChargeRequest {
				return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR"}
			}

			// First over gRPC (grpcurl), then curl and Connect.
			key := idemkey.NewKey()
			first, _, err := e.viaGRPC(t, key, req(100))
			if err != nil {
				t.Fatal(err)
			}
			code, charge, _, h := e.viaHTTP(t, key, jsonOf(t, req(100)))
			if code != http.StatusCreated || !proto.Equal(charge, first) || h.Get(idemkey.ReplayedHeader) != "true" {
				t.Fatalf("curl after grpcurl: %d %v (replayed %q), want 201 with %v replayed", code, charge, h.Get(idemkey.ReplayedHeader), first)
			}
			viaConnect, replayed, err := e.viaConnect(t, key, req(100))
			if err != nil || !replayed || !proto.Equal(viaConnect, first) {
				t.Fatalf("Connect after grpcurl: %v %v (replayed %v), want %v", err, viaConnect, replayed, first)
			}
			// Another request with the key: refused over each.
			code, _, problem, _ := e.viaHTTP(t, key, jsonOf(t, req(200)))
			if code != http.StatusUnprocessableEntity || idemhttp.ProblemReason(problem.Type) != idemkey.ReasonKeyReused {
				t.Fatalf("curl, another request: %d %+v, want 422 %s", code, problem, idemkey.ReasonKeyReused)
			}
			if _, _, err := e.viaConnect(t, key, req(200)); connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
				t.Fatalf("Connect, another request: %v, want %s", err, idemkey.ReasonKeyReused)
			}

			// First over curl, then grpcurl; the JSON body may name its
			// fields either way, and carry the key as request_id.
			key = idemkey.NewKey()
			code, first, _, _ = e.viaHTTP(t, "", `{"customer_id":"cus_1","amount":"300","currency":"EUR","request_id":"`+key+`"}`)
			if code != http.StatusCreated {
				t.Fatalf("curl with request_id: %d", code)
			}
			again, replayed, err := e.viaGRPC(t, key, req(300))
			if err != nil || !replayed || !proto.Equal(again, first) {
				t.Fatalf("grpcurl after curl: %v %v (replayed %v), want %v", err, again, replayed, first)
			}
			// A key in the header and another in request_id: refused.
			code, _, problem, _ = e.viaHTTP(t, idemkey.NewKey(), `{"customerId":"cus_1","amount":"300","currency":"EUR","requestId":"`+key+`"}`)
			if code != http.StatusBadRequest || idemhttp.ProblemReason(problem.Type) != idemkey.ReasonKeyInvalid {
				t.Fatalf("two keys: %d %+v, want 400 %s", code, problem, idemkey.ReasonKeyInvalid)
			}

			// A key sent as the draft's sf-string, quoted, is the same key
			// over curl and Connect as the bare one over gRPC.
			key = idemkey.NewKey()
			code, first, _, _ = e.viaHTTP(t, `"`+key+`"`, jsonOf(t, req(500)))
			if code != http.StatusCreated {
				t.Fatalf("curl with a quoted key: %d", code)
			}
			viaConnect, replayed, err = e.viaConnect(t, `"`+key+`"`, req(500))
			if err != nil || !replayed || !proto.Equal(viaConnect, first) {
				t.Fatalf("Connect with the quoted key: %v %v (replayed %v), want %v", err, viaConnect, replayed, first)
			}
			again, replayed, err = e.viaGRPC(t, key, req(500))
			if err != nil || !replayed || !proto.Equal(again, first) {
				t.Fatalf("grpcurl with the bare key: %v %v (replayed %v), want %v", err, again, replayed, first)
			}

			// First over Connect, then gRPC.
			key = idemkey.NewKey()
			first, _, err = e.viaConnect(t, key, req(400))
			if err != nil {
				t.Fatal(err)
			}
			again, replayed, err = e.viaGRPC(t, key, req(400))
			if err != nil || !replayed || !proto.Equal(again, first) {
				t.Fatalf("grpcurl after Connect: %v %v (replayed %v), want %v", err, again, replayed, first)
			}
		})
	}
}

// One header value names one key on every entry point: sent bare, quoted
// (the IETF draft's sf-string) or quoted with escapes, the same value over
// gRPC, Connect (JSON and proto), gRPC-Web and grpc-gateway (POST
// /v1/charges) runs the charge once, and every other entry point replays
// that charge. Each form is also read as the key it names: the bare and the
// quoted form of one key are one key. On memory, and on PostgreSQL in both
// modes.
func TestOneValueOneKeyOnEveryEntryPoint(t *testing.T) {
	for name, cfg := range storeConfigs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			oneValueOneKey(t, startEntryPoints(t, cfg(t)))
		})
	}
}

// storeConfigs are the example server on memory, and on PostgreSQL in both
// modes.
var storeConfigs = map[string]func(t *testing.T) config{
	"memory": func(*testing.T) config { return config{} },
	"postgres/atomic": func(t *testing.T) config {
		return config{databaseURL: pgtest.SchemaURL(pgtest.Schema(t)), atomic: true}
	},
	"postgres/2-phase": func(t *testing.T) config { return config{databaseURL: pgtest.SchemaURL(pgtest.Schema(t))} },
}

// oneValueOneKey runs its cases on e and returns how many keys they sent,
// each a charge.
func oneValueOneKey(t *testing.T, e *entryPoints) (keys int) {
	ctx := t.Context()
	connectClient := func(opts ...connect.ClientOption) func(string, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
		c := paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, e.http, opts...)
		return func(value string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
			r := connect.NewRequest(req)
			r.Header().Set("Authorization", "Bearer sk_test_acme")
			r.Header().Set(idemkey.KeyHeader, value)
			resp, err := c.CreateCharge(ctx, r)
			if err != nil {
				return nil, false, err
			}
			return resp.Msg, idemkey.ParseReplayed(resp.Header().Values(idemkey.ReplayedHeader)) || idemkey.ParseReplayed(resp.Trailer().Values(idemkey.ReplayedHeader)), nil
		}
	}
	entryPoints := []struct {
		name string
		call func(value string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error)
	}{
		{"gRPC", func(value string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
			return e.viaGRPC(t, value, req)
		}},
		{"Connect JSON", connectClient(connect.WithProtoJSON())},
		{"Connect proto", connectClient()},
		{"gRPC-Web", connectClient(connect.WithGRPCWeb())},
		{"grpc-gateway", func(value string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, bool, error) {
			code, charge, problem, h := e.viaHTTP(t, value, jsonOf(t, req))
			if code != http.StatusCreated {
				return nil, false, fmt.Errorf("%d %+v", code, problem)
			}
			return charge, h.Get(idemkey.ReplayedHeader) == "true", nil
		}},
	}
	forms := []struct {
		name  string
		value func(key string) string
	}{
		{"bare", func(key string) string { return key }},
		{"quoted", func(key string) string { return `"` + key + `"` }},
		{"quoted with escapes", func(key string) string { return `"sf\"key\\` + key + `"` }},
	}
	for i, form := range forms {
		req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: int64(100 + i), Currency: "EUR"}
		// Each entry point first once, with a key of its own, the others after it.
		for first := range entryPoints {
			value := form.value("sfkey-" + idemkey.NewKey())
			keys++
			var charge *paymentsv1.Charge
			for j := range entryPoints {
				ep := entryPoints[(first+j)%len(entryPoints)]
				got, replayed, err := ep.call(value, req)
				switch {
				case err != nil:
					t.Fatalf("%s, %s key: %v", ep.name, form.name, err)
				case j == 0 && replayed:
					t.Fatalf("%s, %s key, the first call: replayed", ep.name, form.name)
				case j == 0:
					charge = got
				case !replayed || !proto.Equal(got, charge):
					t.Fatalf("%s, %s key, after %s: %v (replayed %v), want %v replayed: one value, two keys",
						ep.name, form.name, entryPoints[first].name, got, replayed, charge)
				}
			}
		}
	}
	// The bare and the quoted form of one key are one key, on every entry point.
	key := "sfkey-" + idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 999, Currency: "EUR"}
	first, _, err := entryPoints[0].call(key, req)
	if err != nil {
		t.Fatal(err)
	}
	for _, ep := range entryPoints {
		if got, replayed, err := ep.call(`"`+key+`"`, req); err != nil || !replayed || !proto.Equal(got, first) {
			t.Fatalf("%s with the quoted form of a key sent bare before: %v, %v (replayed %v), want %v replayed", ep.name, got, err, replayed, first)
		}
	}
	return keys + 1
}

// POST /v1/charges, through grpc-gateway, answers as
// draft-ietf-httpapi-idempotency-key-header-07 says and as the table of
// docs/http.md lists: 400 for a missing or malformed key or first-sent
// time, 422 for a key reused with another request, 412 for a stale
// first-sent time without a record, 409 with Retry-After while the first
// request runs, 503 with Retry-After when the store is full; the charge's
// own errors are problems too.
func TestGatewayDraftStatuses(t *testing.T) {
	e := startEntryPoints(t, config{delay: 3 * time.Second})
	body := `{"customer_id":"cus_1","amount":"100","currency":"EUR"}`
	reused := idemkey.NewKey()
	if code, _, problem, _ := e.viaHTTP(t, reused, body); code != http.StatusCreated {
		t.Fatalf("a first charge: %d %+v", code, problem)
	}
	stale := "Sunday, 06-Nov-94 08:49:37 GMT" // RFC 850, a form a recipient must read
	for _, tc := range []struct {
		name, key, firstSent, body string
		status                     int
		reason                     string
	}{
		{"no key", "", "", body, http.StatusBadRequest, idemkey.ReasonKeyMissing},
		{"malformed key", `"a key"`, "", body, http.StatusBadRequest, idemkey.ReasonKeyInvalid},
		{"reused key", reused, "", `{"customer_id":"cus_1","amount":"200","currency":"EUR"}`, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused},
		{"malformed first-sent", idemkey.NewKey(), "yesterday", body, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid},
		{"stale first-sent", idemkey.NewKey(), stale, body, http.StatusPreconditionFailed, idemkey.ReasonKeyExpired},
		{"not JSON", idemkey.NewKey(), "", `{"amount":`, http.StatusBadRequest, ""},
		{"invalid request", idemkey.NewKey(), "", `{"customer_id":"cus_1","amount":"-1","currency":"EUR"}`, http.StatusBadRequest, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, problem, _ := e.viaHTTP(t, tc.key, tc.body, idemkey.FirstSentHeader, tc.firstSent)
			if code != tc.status || idemhttp.ProblemReason(problem.Type) != tc.reason || problem.Status != tc.status {
				t.Fatalf("got %d %+v, want %d with reason %q", code, problem, tc.status, tc.reason)
			}
		})
	}
	t.Run("store full", func(t *testing.T) {
		// Room for one charge of a tenant's (half the store): its key's
		// record and its step's.
		full := startEntryPoints(t, config{maxRecords: 4})
		if code, _, problem, _ := full.viaHTTP(t, idemkey.NewKey(), body); code != http.StatusCreated {
			t.Fatalf("the one charge: %d %+v", code, problem)
		}
		code, _, problem, h := full.viaHTTP(t, idemkey.NewKey(), body)
		if code != http.StatusServiceUnavailable || idemhttp.ProblemReason(problem.Type) != idemkey.ReasonStoreFull || h.Get("Retry-After") == "" {
			t.Fatalf("a key past the store's room: %d %+v Retry-After %q, want 503 %s with Retry-After", code, problem, h.Get("Retry-After"), idemkey.ReasonStoreFull)
		}
	})
	t.Run("in progress", func(t *testing.T) {
		key := idemkey.NewKey()
		first := make(chan int, 1)
		go func() {
			code, _, _, _ := e.viaHTTP(t, key, body)
			first <- code
		}()
		time.Sleep(200 * time.Millisecond) // the first reaches the handler, which holds it 3s
		code, _, problem, h := e.viaHTTP(t, key, body)
		if code != http.StatusConflict || idemhttp.ProblemReason(problem.Type) != idemkey.ReasonInProgress || h.Get("Retry-After") == "" {
			t.Fatalf("duplicate: %d %+v Retry-After %q, want 409 %s with Retry-After", code, problem, h.Get("Retry-After"), idemkey.ReasonInProgress)
		}
		if code := <-first; code != http.StatusCreated {
			t.Fatalf("first: %d", code)
		}
	})
}

// Duplicates of a running call over every entry point at once (gRPC,
// Connect and POST /v1/charges, twenty each, with one key) wait on the
// same run: each is answered the one charge, or in progress if the run
// outlasts its wait on a busy machine, never another charge or an error.
// On memory, and on PostgreSQL in both modes, where the example server
// runs the store's Listen.
func TestDuplicatesOnEveryEntryPointWaitTogether(t *testing.T) {
	for name, cfg := range storeConfigs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			c := cfg(t)
			c.delay = 300 * time.Millisecond
			e := startEntryPoints(t, c)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_every", Amount: 700, Currency: "EUR"}
			body := jsonOf(t, req)
			type answer struct {
				via, id    string
				inProgress bool
				err        error
			}
			calls := map[string]func() answer{
				"gRPC": func() answer {
					charge, _, err := e.viaGRPC(t, key, req)
					return answer{id: charge.GetId(), inProgress: idemkey.Reason(err) == idemkey.ReasonInProgress, err: err}
				},
				"Connect": func() answer {
					charge, _, err := e.viaConnect(t, key, req)
					return answer{id: charge.GetId(), inProgress: idemkey.Reason(err) == idemkey.ReasonInProgress, err: err}
				},
				"HTTP": func() answer {
					r, err := http.NewRequestWithContext(t.Context(), http.MethodPost, e.http+"/v1/charges", strings.NewReader(body))
					if err != nil {
						return answer{err: err}
					}
					r.Header.Set("Authorization", "Bearer sk_test_acme")
					r.Header.Set(idemkey.KeyHeader, key)
					resp, err := http.DefaultClient.Do(r)
					if err != nil {
						return answer{err: err}
					}
					defer resp.Body.Close()
					raw, _ := io.ReadAll(resp.Body)
					if resp.StatusCode == http.StatusConflict {
						return answer{inProgress: true, err: fmt.Errorf("409 %s", raw)}
					}
					charge := &paymentsv1.Charge{}
					if resp.StatusCode != http.StatusCreated {
						return answer{err: fmt.Errorf("status %d: %s", resp.StatusCode, raw)}
					}
					err = protojson.Unmarshal(raw, charge)
					return answer{id: charge.GetId(), err: err}
				},
			}
			answers := make(chan answer, 3*20)
			var wg sync.WaitGroup
			for via, call := range calls {
				for range 20 {
					wg.Go(func() {
						a := call()
						a.via = via
						answers <- a
					})
				}
			}
			wg.Wait()
			close(answers)
			ids, inProgress := map[string]int{}, 0
			for a := range answers {
				switch {
				case a.inProgress:
					inProgress++
				case a.err != nil:
					t.Errorf("%s: %v", a.via, a.err)
				default:
					ids[a.id]++
				}
			}
			if len(ids) != 1 {
				t.Errorf("the calls were answered charges %v, want one charge", ids)
			}
			t.Logf("%s: charges %v, %d in progress", name, ids, inProgress)
		})
	}
}

// The built server's POST /v1/charges, through grpc-gateway, refuses a key
// that gRPC metadata cannot carry (a UTF-8 letter, a tab inside) as
// malformed, as idemhttp does, and charges nothing, however often it is
// sent, rather than drop the key: since the server requires a key, the
// client would be told it sent none, or with the body's request_id the
// charge would run under that key, the header's unseen. The server's log
// never holds the key. A key it can carry charges once.
func TestGatewayRefusesKeysItCannotForward(t *testing.T) {
	bin := servertest.Build(t)
	schema := pgtest.Schema(t)
	addrFile := filepath.Join(t.TempDir(), "http-addr")
	s := servertest.Start(t, bin, "-database-url", pgtest.SchemaURL(schema), "-http-addr", "127.0.0.1:0", "-http-addr-file", addrFile)
	var addr []byte
	waitUntil(t, "the HTTP address file is written", func() bool {
		addr, _ = os.ReadFile(addrFile)
		return len(addr) > 0
	})
	e := &entryPoints{http: "http://" + strings.TrimSpace(string(addr))}
	pool := pgtest.Pool(t, schema)
	body := `{"customer_id":"cus_1","amount":"100","currency":"EUR"}`
	for _, tc := range []struct{ key, body string }{
		{"order-42-café", body},
		{"order-43\tcafe", body},
		{"order-44-café", `{"customer_id":"cus_1","amount":"100","currency":"EUR","request_id":"order-44"}`},
	} {
		var got []string
		for range 3 {
			code, _, problem, _ := e.viaHTTP(t, tc.key, tc.body)
			got = append(got, fmt.Sprint(code, " ", idemhttp.ProblemReason(problem.Type)))
		}
		want := fmt.Sprint(http.StatusBadRequest, " ", idemkey.ReasonKeyInvalid)
		if !slices.Equal(got, []string{want, want, want}) {
			t.Errorf("%q, %s thrice: %q; want %s thrice", tc.key, tc.body, got, want)
		}
		if n := count(t, pool, "charges"); n != 0 {
			t.Errorf("%q, %s thrice: %d charges; want 0", tc.key, tc.body, n)
		}
	}
	for range 3 {
		if code, _, problem, _ := e.viaHTTP(t, "order-42", body); code != http.StatusCreated {
			t.Fatalf("order-42: %d %+v; want 201", code, problem)
		}
	}
	if n := count(t, pool, "charges"); n != 1 {
		t.Errorf("order-42 thrice: %d charges; want 1", n)
	}
	if logs := s.Logs(); strings.Contains(logs, "café") || strings.Contains(logs, "cafe") {
		t.Errorf("the server's log holds a key:\n%s", logs)
	}
}

// fateOf is the one fate an answer is marked with: "executed" (the key's
// first execution), "replayed", "ignored" (not honoured), "" for none, or
// "two fates".
func fateOf(replayed, status []string) string {
	fates := ""
	for _, f := range []struct {
		marked bool
		name   string
	}{{idemkey.ParseExecuted(replayed), "executed"}, {idemkey.ParseReplayed(replayed), "replayed"}, {idemkey.ParseIgnored(status), "ignored"}} {
		switch {
		case f.marked && fates != "":
			return "two fates"
		case f.marked:
			fates = f.name
		}
	}
	return fates
}

// Every answer of CreateCharge, a charge or a recorded decline, over gRPC,
// Connect, gRPC-Web and the gateway, is marked the key's first execution or
// its replay; a key sent to GetCharge, which is not covered
// (NO_SIDE_EFFECTS), is answered as ignored, a charge or NotFound alike.
func TestEveryAnswerStatesTheKeysFate(t *testing.T) {
	for name, cfg := range storeConfigs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			everyAnswerStatesTheKeysFate(t, startEntryPoints(t, cfg(t)))
		})
	}
}

func everyAnswerStatesTheKeysFate(t *testing.T, e *entryPoints) {
	ctx := t.Context()
	// Each entry point makes a call of either method and returns the
	// charge's id ("" for an error) and the answer's fate.
	type entryPoint struct {
		name   string
		create func(key string, req *paymentsv1.CreateChargeRequest) (string, string)
		get    func(key, id string) (string, string)
	}
	grpcCall := func(key string, call func(ctx context.Context, opts ...grpc.CallOption) (*paymentsv1.Charge, error)) (string, string) {
		ctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		charge, _ := call(ctx, grpc.Trailer(&trailer))
		return charge.GetId(), fateOf(trailer.Get(idemkey.ReplayedMetadata), trailer.Get(idemkey.StatusMetadata))
	}
	connectEntry := func(name string, opts ...connect.ClientOption) entryPoint {
		c := paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, e.http, opts...)
		// The marks are in the header of a reply (and, over gRPC-Web, its
		// trailer), in the metadata of an error.
		answer := func(resp *connect.Response[paymentsv1.Charge], err error) (string, string) {
			var ce *connect.Error
			if errors.As(err, &ce) {
				return "", fateOf(ce.Meta().Values(idemkey.ReplayedHeader), ce.Meta().Values(idemkey.StatusHeader))
			}
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			return resp.Msg.GetId(), fateOf(resp.Header().Values(idemkey.ReplayedHeader), resp.Header().Values(idemkey.StatusHeader))
		}
		headers := func(h http.Header, key string) {
			h.Set("Authorization", "Bearer sk_test_acme")
			h.Set(idemkey.KeyHeader, key)
		}
		return entryPoint{name: name,
			create: func(key string, req *paymentsv1.CreateChargeRequest) (string, string) {
				r := connect.NewRequest(req)
				headers(r.Header(), key)
				return answer(c.CreateCharge(ctx, r))
			},
			get: func(key, id string) (string, string) {
				r := connect.NewRequest(&paymentsv1.GetChargeRequest{Id: id})
				headers(r.Header(), key)
				return answer(c.GetCharge(ctx, r))
			},
		}
	}
	gateway := func(method, path, key, body string) (string, string) {
		req, err := http.NewRequestWithContext(ctx, method, e.http+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer sk_test_acme")
		req.Header.Set(idemkey.KeyHeader, key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		charge := &paymentsv1.Charge{}
		if raw, _ := io.ReadAll(resp.Body); resp.StatusCode < 300 {
			if err := protojson.Unmarshal(raw, charge); err != nil {
				t.Fatalf("charge %s: %v", raw, err)
			}
		}
		return charge.GetId(), fateOf(resp.Header.Values(idemkey.ReplayedHeader), resp.Header.Values(idemkey.StatusHeader))
	}
	entryPoints := []entryPoint{
		{name: "gRPC",
			create: func(key string, req *paymentsv1.CreateChargeRequest) (string, string) {
				return grpcCall(key, func(ctx context.Context, opts ...grpc.CallOption) (*paymentsv1.Charge, error) {
					return e.grpc.CreateCharge(ctx, req, opts...)
				})
			},
			get: func(key, id string) (string, string) {
				return grpcCall(key, func(ctx context.Context, opts ...grpc.CallOption) (*paymentsv1.Charge, error) {
					return e.grpc.GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: id}, opts...)
				})
			},
		},
		connectEntry("Connect JSON", connect.WithProtoJSON()),
		connectEntry("Connect proto"),
		connectEntry("gRPC-Web", connect.WithGRPCWeb()),
		{name: "grpc-gateway",
			create: func(key string, req *paymentsv1.CreateChargeRequest) (string, string) {
				return gateway(http.MethodPost, "/v1/charges", key, jsonOf(t, req))
			},
			get: func(key, id string) (string, string) { return gateway(http.MethodGet, "/v1/charges/"+id, key, "") },
		},
	}
	for i, ep := range entryPoints {
		charge := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: int64(100 + i), Currency: "EUR"}
		declined := &paymentsv1.CreateChargeRequest{CustomerId: example.DeclinedCustomer, Amount: int64(100 + i), Currency: "EUR"}
		var id string
		for _, req := range []*paymentsv1.CreateChargeRequest{charge, declined} {
			key := idemkey.NewKey()
			for j, want := range []string{"executed", "replayed", "replayed"} {
				got, fate := ep.create(key, req)
				if fate != want || (req == charge) != (got != "") {
					t.Errorf("%s: CreateCharge for %s, call %d: %q marked %q, want %q", ep.name, req.GetCustomerId(), j+1, got, fate, want)
				}
				id = cmp.Or(id, got)
			}
		}
		for _, getID := range []string{id, "ch_missing"} {
			if got, fate := ep.get(idemkey.NewKey(), getID); fate != "ignored" || (getID == id) != (got == id) {
				t.Errorf("%s: GetCharge %s with a key: %q marked %q, want %q", ep.name, getID, got, fate, "ignored")
			}
		}
	}
}
