package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	otelprometheus "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"google.golang.org/grpc"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/memory"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

// The demo runs against the example server over loopback and checks every
// answer itself; its transcript shows the duplicate converging, and ends
// with the server's idemkey_calls_total counters, a row per outcome and code.
func TestDemo(t *testing.T) {
	meters, metricsURL := serveMetrics(t)
	eng, err := example.NewEngine(memory.New(), engine.WithMeterProvider(meters))
	if err != nil {
		t.Fatal(err)
	}
	srv, _, _ := example.NewServer(eng, example.Config{
		HandlerDelay:  time.Second,
		ServerOptions: []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithMeterProvider(meters)))},
	})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	var out bytes.Buffer
	if err := run(context.Background(), lis.Addr().String(), "sk_test_acme", 5*time.Second, metricsURL, &out); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		"the server held the duplicate until the first call finished", // whichever of the two calls arrived second
		"OK [idempotent-replayed: true]",
		"GMT [idempotency-key-expires]: a retry before then is answered from its record",
		"the same instant",
		"InvalidArgument IDEMPOTENCY_KEY_REUSED",
		"InvalidArgument IDEMPOTENCY_KEY_MISSING",
		"FailedPrecondition: card declined [idempotent-replayed: true]",
		"merchant_reference of the first charge (the business-level second line of defence)\n   -> AlreadyExists",
		"cus_alice_",
		" has 1 charge(s)",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("transcript lacks %q:\n%s", want, out.String())
		}
	}
	// Each scene's calls, counted: the duplicate is held until the first
	// call ends and replayed (checked above), the decline is recorded.
	_, table, _ := strings.Cut(out.String(), "The server counted these calls (idemkey_calls_total at "+metricsURL+"):\n")
	if got, want := rows(table), []string{
		"outcome code calls",
		"executed OK 2",
		"executed AlreadyExists 1",
		"executed FailedPrecondition 1",
		"key_missing InvalidArgument 1",
		"replayed OK 2",
		"replayed FailedPrecondition 1",
		"reused InvalidArgument 1",
	}; !slices.Equal(got, want) {
		t.Errorf("the counters' table is\n%s\nwant\n%s\ntranscript:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"), out.String())
	}
}

// With -metrics-url, the counters are summed over methods, and a URL with no
// idemkey_calls_total fails the demo.
func TestPrintCalls(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `# TYPE idemkey_calls_total counter
idemkey_calls_total{idemkey_outcome="replayed",rpc_response_status_code="OK",rpc_method="B"} 1
idemkey_calls_total{idemkey_outcome="in_progress",rpc_response_status_code="ABORTED",rpc_method="A"} 4
idemkey_calls_total{idemkey_outcome="replayed",rpc_response_status_code="OK",rpc_method="A"} 2
# TYPE other_total counter
other_total 7
`)
	})
	mux.HandleFunc("/empty", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "other_total 7") })
	hs := httptest.NewServer(mux)
	defer hs.Close()

	var out bytes.Buffer
	if err := printCalls(context.Background(), hs.URL+"/metrics", &out); err != nil {
		t.Fatal(err)
	}
	if got, want := rows(out.String()), []string{
		"The server counted these calls (idemkey_calls_total at " + hs.URL + "/metrics):",
		"outcome code calls",
		"in_progress Aborted 4",
		"replayed OK 3",
	}; !slices.Equal(got, want) {
		t.Errorf("printed\n%s\nwant\n%s", out.String(), strings.Join(want, "\n"))
	}
	for _, path := range []string{"/empty", "/missing"} {
		if err := printCalls(context.Background(), hs.URL+path, io.Discard); err == nil {
			t.Errorf("%s: no error", path)
		}
	}
}

// rows returns the non-empty lines of text with their fields separated by
// one space.
func rows(text string) []string {
	var rows []string
	for line := range strings.SplitSeq(text, "\n") {
		if fields := strings.Fields(line); len(fields) > 0 {
			rows = append(rows, strings.Join(fields, " "))
		}
	}
	return rows
}

// serveMetrics serves a MeterProvider's metrics in the Prometheus text
// format, as the example server's -metrics-addr does, until t ends.
func serveMetrics(t *testing.T) (metric.MeterProvider, string) {
	t.Helper()
	registry := prometheus.NewRegistry()
	exporter, err := otelprometheus.New(otelprometheus.WithRegisterer(registry))
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	hs := httptest.NewServer(promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	t.Cleanup(func() {
		hs.Close()
		_ = mp.Shutdown(context.Background())
	})
	return mp, hs.URL + "/metrics"
}

// make demo's script (scripts/demo) on PostgreSQL passes run after run on
// one database, on a free port, and says which store it uses.
func TestDemoScriptTwiceOnPostgres(t *testing.T) {
	bin := buildDemo(t)
	url := pgtest.SchemaURL(pgtest.Schema(t))
	for run := range 2 {
		out, err := demoScript(bin, "DATABASE_URL="+url)
		if err != nil {
			t.Fatalf("run %d: %v\n%s", run+1, err, out)
		}
		for _, want := range []string{"keeps keys and charges in PostgreSQL", "-> AlreadyExists", "Every retry and duplicate was answered", "The server counted these calls (idemkey_calls_total at http://127.0.0.1:"} {
			if !strings.Contains(out, want) {
				t.Errorf("run %d lacks %q:\n%s", run+1, want, out)
			}
		}
		// A server of its own per run: its counters start at zero.
		for _, want := range []string{"outcome code calls", "executed OK 2", "replayed OK 2", "reused InvalidArgument 1", "key_missing InvalidArgument 1"} {
			if !slices.Contains(rows(out), want) {
				t.Errorf("run %d: the counters lack the row %q:\n%s", run+1, want, out)
			}
		}
	}
}

// When DEMO_ADDR names a port another program holds, make demo's script
// fails naming the port and DEMO_ADDR, and its client never connects to
// that program.
func TestDemoScriptPortTaken(t *testing.T) {
	bin := buildDemo(t)
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	var accepted atomic.Int32
	go func() {
		for {
			c, err := other.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	addr := other.Addr().String()
	out, err := demoScript(bin, "DEMO_ADDR="+addr, "DATABASE_URL=")
	if err == nil {
		t.Fatalf("the demo passed with its port taken:\n%s", out)
	}
	_, port, _ := net.SplitHostPort(addr)
	if want := "DEMO_ADDR=" + addr + " (port " + port + ")"; !strings.Contains(out, want) {
		t.Errorf("the output lacks %q:\n%s", want, out)
	}
	if n := accepted.Load(); n != 0 {
		t.Errorf("the demo connected %d times to the program on its port", n)
	}
}

// buildDemo builds the example server and the demo client into a directory
// of the test's.
func buildDemo(t *testing.T) string {
	t.Helper()
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin, "github.com/idemkey/idemkey/example/server", "github.com/idemkey/idemkey/example/client")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// demoScript runs scripts/demo with the binaries in bin and env added to the
// environment, and returns its output.
func demoScript(bin string, env ...string) (string, error) {
	cmd := exec.Command(filepath.Join("..", "..", "scripts", "demo"), "-handler-delay=500ms")
	cmd.Env = append(os.Environ(), append([]string{"BIN=" + bin, "DEMO_ADDR="}, env...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}
