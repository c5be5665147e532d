package main

import (
	"context"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// With -metrics-addr, the server on PostgreSQL counts each call on /metrics
// under its idemkey outcome and status code: a first call, its replay, a
// reused key and a duplicate answered while the first call runs each move
// their own counter and no other. Beside them are gRPC's own metrics
// (otelgrpc) and the janitor's; and no key, tenant or request value, nor a
// key's hash, appears anywhere in the scrape.
// handlerDelay is how long the server's CreateCharge runs: twice its
// in-progress wait, so that a duplicate is answered Aborted while the first
// call still runs.
const handlerDelay = 4 * time.Second

func TestMetrics(t *testing.T) {
	url := pgtest.SchemaURL(pgtest.Schema(t))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsFile := filepath.Join(t.TempDir(), "metrics-addr")
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, lis, config{
			databaseURL: url, atomic: true, delay: handlerDelay, ttl: time.Hour,
			metricsAddr: "127.0.0.1:0", metricsAddrFile: metricsFile,
		}, slog.New(slog.DiscardHandler))
	}()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
		if _, err := os.Stat(metricsFile); !os.IsNotExist(err) {
			t.Errorf("the metrics address file outlived the server: %v", err)
		}
	}()
	var addr []byte
	waitUntil(t, "the metrics address file is written", func() bool {
		addr, _ = os.ReadFile(metricsFile)
		return len(addr) > 0
	})
	metricsURL := "http://" + strings.TrimSpace(string(addr)) + "/metrics"

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)
	call := func(ctx context.Context, key string, req *paymentsv1.CreateChargeRequest) error {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		_, err := client.CreateCharge(ctx, req)
		return err
	}

	var texts []string // every scrape, for the leak check
	counts := map[string]float64{}
	// moved scrapes /metrics and checks that idemkey_calls_total moved by
	// want since the last scrape, want naming "outcome/code".
	moved := func(step string, want map[string]float64) {
		t.Helper()
		text := scrape(t, metricsURL)
		texts = append(texts, text)
		now := callCounts(t, text)
		got := map[string]float64{}
		for series, n := range now {
			if d := n - counts[series]; d != 0 {
				got[series] = d
			}
		}
		if !maps.Equal(got, want) {
			t.Errorf("%s moved idemkey_calls_total by %v, want %v\nscrape:\n%s", step, got, want, callLines(text))
		}
		counts = now
	}
	moved("nothing", map[string]float64{})

	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_metrics_alice", Amount: 1999, Currency: "EUR", Description: "Metrics test plan"}
	if err := call(ctx, key, req); err != nil {
		t.Fatalf("first call: %v", err)
	}
	moved("a first call", map[string]float64{"executed/OK": 1})
	if err := call(ctx, key, req); err != nil {
		t.Fatalf("replay: %v", err)
	}
	moved("a replay", map[string]float64{"replayed/OK": 1})
	changed := &paymentsv1.CreateChargeRequest{CustomerId: "cus_metrics_alice", Amount: 2500, Currency: "EUR", Description: "Metrics test plan"}
	if err := call(ctx, key, changed); idemkey.Reason(err) != idemkey.ReasonKeyReused {
		t.Fatalf("reused key: %v, want %s", err, idemkey.ReasonKeyReused)
	}
	moved("a reused key", map[string]float64{"reused/INVALID_ARGUMENT": 1})

	// A duplicate of a call that runs for handlerDelay: the server holds it
	// for its in-progress wait (2s, well short of handlerDelay), then answers
	// it Aborted. The duplicate has no deadline of its own, so a busy machine
	// delays the answer but cannot change it.
	dupKey := idemkey.NewKey()
	dupReq := &paymentsv1.CreateChargeRequest{CustomerId: "cus_metrics_bob", Amount: 500, Currency: "USD", Description: "Metrics test beans"}
	begun := storeOps(t, scrape(t, metricsURL), "begin")
	first := make(chan error, 1)
	go func() { first <- call(ctx, dupKey, dupReq) }()
	waitUntil(t, "the first call has reserved its key", func() bool {
		return storeOps(t, scrape(t, metricsURL), "begin") > begun
	})
	if err := call(ctx, dupKey, dupReq); status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate during the first call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
	}
	moved("a duplicate in progress", map[string]float64{"in_progress/ABORTED": 1})
	if err := <-first; err != nil {
		t.Fatalf("first call of the duplicate: %v", err)
	}
	moved("the duplicate's first call", map[string]float64{"executed/OK": 1})

	// The other instruments: otelgrpc's, the interceptor's store and record
	// sizes, and the janitor's (which sweeps once at start).
	waitUntil(t, "the janitor's sweep is counted", func() bool {
		return strings.Contains(scrape(t, metricsURL), "\nidemkey_sweep_deleted_total{")
	})
	text := scrape(t, metricsURL)
	texts = append(texts, text)
	for _, want := range []string{
		`rpc_server_call_duration_seconds_count{`,
		`rpc_method="example.payments.v1.PaymentService/CreateCharge"`,
		`idemkey_store_duration_seconds_bucket{idemkey_store_operation="commit"`,
		`idemkey_store_duration_seconds_bucket{idemkey_store_operation="sweep"`,
		`idemkey_record_size_bytes_count{`,
		`idemkey_calls_total{idemkey_outcome="executed",otel_scope_name="github.com/idemkey/idemkey/engine",otel_scope_schema_url="",otel_scope_version="",rpc_method="example.payments.v1.PaymentService/CreateCharge",rpc_response_status_code="OK",rpc_service="example.payments.v1.PaymentService",rpc_system_name="grpc"} 2`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the scrape lacks %s", want)
		}
	}

	secrets := []string{"acme", "sk_test", key, dupKey, "cus_metrics", "Metrics test"}
	for _, k := range []string{key, dupKey} {
		for _, method := range []string{paymentsv1.PaymentService_CreateCharge_FullMethodName, ""} {
			secrets = append(secrets, store.ScopeKey("acme", method, k).String())
		}
	}
	for _, text := range texts {
		for _, secret := range secrets {
			if strings.Contains(text, secret) {
				t.Errorf("the scrape holds %q:\n%s", secret, text)
			}
		}
	}
}

// scrape returns the text at url.
func scrape(t *testing.T, url string) string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Close = true // no idle connection left for leakcheck to find
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s, %v\n%s", url, resp.Status, err, body)
	}
	return string(body)
}

var (
	outcomeLabel = regexp.MustCompile(`[{,]idemkey_outcome="([a-z_]+)"`)
	codeLabel    = regexp.MustCompile(`[{,]rpc_response_status_code="([A-Z_]+)"`)
	opLabel      = regexp.MustCompile(`[{,]idemkey_store_operation="([a-z]+)"`)
)

// callLines returns the lines of text that are idemkey_calls_total samples.
func callLines(text string) []string {
	var lines []string
	for line := range strings.SplitSeq(text, "\n") {
		if strings.HasPrefix(line, "idemkey_calls_total{") {
			lines = append(lines, line)
		}
	}
	return lines
}

// callCounts reads the idemkey_calls_total samples of a scrape, by
// "outcome/code".
func callCounts(t *testing.T, text string) map[string]float64 {
	t.Helper()
	counts := map[string]float64{}
	for _, line := range callLines(text) {
		outcome, code := outcomeLabel.FindStringSubmatch(line), codeLabel.FindStringSubmatch(line)
		if outcome == nil || code == nil {
			t.Fatalf("idemkey_calls_total without idemkey_outcome or rpc_response_status_code: %s", line)
		}
		counts[outcome[1]+"/"+code[1]] += sampleValue(t, line)
	}
	return counts
}

// storeOps counts the interceptor's store operations op in a scrape.
func storeOps(t *testing.T, text, op string) float64 {
	t.Helper()
	var n float64
	for line := range strings.SplitSeq(text, "\n") {
		if m := opLabel.FindStringSubmatch(line); m != nil && m[1] == op && strings.HasPrefix(line, "idemkey_store_duration_seconds_count{") {
			n += sampleValue(t, line)
		}
	}
	return n
}

func sampleValue(t *testing.T, line string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
	if err != nil {
		t.Fatalf("sample %q: %v", line, err)
	}
	return v
}
