package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/memory"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The demo runs against the example server over loopback and checks every
// answer itself; its transcript shows the duplicate converging.
func TestDemo(t *testing.T) {
	srv, _ := example.NewServer(memory.New(), example.Config{HandlerDelay: time.Second})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	var out bytes.Buffer
	if err := run(context.Background(), lis.Addr().String(), "sk_test_acme", 5*time.Second, &out); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		"the server held the duplicate until the first call finished", // whichever of the two calls arrived second
		"OK [idempotent-replayed: true]",
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
		for _, want := range []string{"keeps keys and charges in PostgreSQL", "-> AlreadyExists", "Every retry and duplicate was answered"} {
			if !strings.Contains(out, want) {
				t.Errorf("run %d lacks %q:\n%s", run+1, want, out)
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
