package main

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(int) {
		if builtBin != "" {
			os.RemoveAll(filepath.Dir(builtBin))
		}
	}))
}

// The server creates its tables on an empty database, answers over loopback,
// stops on its context, and a second run on the same database replays the
// first run's reply, in either mode.
func TestRunOnPostgres(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) { testRunOnPostgres(t, atomic) })
	}
}

func testRunOnPostgres(t *testing.T, atomic bool) {
	url := pgtest.SchemaURL(pgtest.Schema(t))
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	call := func() (*paymentsv1.Charge, metadata.MD) {
		t.Helper()
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- run(ctx, lis, config{databaseURL: url, ttl: time.Hour, atomic: atomic}, slog.New(slog.DiscardHandler))
		}()
		defer func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		}()
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		callCtx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		charge, err := paymentsv1.NewPaymentServiceClient(conn).CreateCharge(callCtx, req, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatalf("CreateCharge: %v", err)
		}
		return charge, trailer
	}
	first, trailer := call()
	if idemkey.Replayed(trailer) {
		t.Fatal("the first call was replayed")
	}
	again, trailer := call()
	if !proto.Equal(first, again) || !idemkey.Replayed(trailer) {
		t.Errorf("after a restart: %v (replayed %v), want the first run's %v, replayed", again, idemkey.Replayed(trailer), first)
	}
}

// Server processes on one database behave as one service: a duplicate sent to
// process B while process A runs the first call is Aborted, the retry on B
// gets A's reply, and the reply survives both processes being killed. They run
// two-phase, so A's charge is visible before its reply is recorded.
func TestProcessesOnOneDatabase(t *testing.T) {
	bin := buildServer(t)
	schema := pgtest.Schema(t)
	url := pgtest.SchemaURL(schema)
	a := startServer(t, bin, url, "-handler-delay=2s", "-atomic=false")
	b := startServer(t, bin, url, "-atomic=false")
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

	first := make(chan *paymentsv1.Charge, 1)
	go func() {
		charge, _, err := a.create(key, req)
		if err != nil {
			t.Errorf("first call on A: %v", err)
		}
		first <- charge
	}()
	pool := pgtest.Pool(t, schema)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if count(t, pool, "charges") == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("process A never wrote the charge")
		}
	}
	if _, _, err := b.create(key, req); status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate on B during A's call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
	}
	want := <-first
	wantReplay := func(s *server, who string) {
		t.Helper()
		got, trailer, err := s.create(key, req)
		if err != nil || !proto.Equal(got, want) || !idemkey.Replayed(trailer) {
			t.Errorf("retry on %s: %v, %v (replayed %v); want A's charge, replayed", who, got, err, idemkey.Replayed(trailer))
		}
	}
	wantReplay(b, "B")

	a.kill()
	b.kill()
	wantReplay(startServer(t, bin, url, "-atomic=false"), "a new process after both were killed")
	if n := count(t, pool, "charges"); n != 1 {
		t.Errorf("%d charges in the database, want 1", n)
	}
}

// A server process killed while its atomic CreateCharge is inside the
// transaction leaves nothing behind: the database rolls back the charge and
// the reservation, and the client's retry on a restarted process charges
// once, with no lease to wait out.
func TestAtomicProcessKilled(t *testing.T) {
	bin := buildServer(t)
	schema := pgtest.Schema(t)
	const app = "idemkey_test_killed"
	a := startServer(t, bin, pgtest.SchemaURL(schema, "application_name="+app), "-handler-delay=1m")
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	first := make(chan error, 1)
	go func() { _, _, err := a.create(key, req); first <- err }()

	pool := pgtest.Pool(t, schema)
	backends := func(state string) int {
		var n int
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE $2`, app, state).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitUntil(t, "A's handler is inside its transaction", func() bool { return backends("idle in transaction") == 1 })
	a.kill()
	if err := <-first; status.Code(err) != codes.Unavailable {
		t.Errorf("the call to the killed process: %v, want Unavailable", err)
	}
	waitUntil(t, "the database has ended A's sessions", func() bool { return backends("%") == 0 })
	if n := count(t, pool, "charges"); n != 0 {
		t.Fatalf("%d charges after the kill, want 0", n)
	}
	if n := count(t, pool, "idempotency_keys"); n != 0 {
		t.Fatalf("%d idempotency records after the kill, want 0", n)
	}

	b := startServer(t, bin, pgtest.SchemaURL(schema))
	charge, trailer, err := b.create(key, req)
	if err != nil || idemkey.Replayed(trailer) {
		t.Fatalf("retry on a restarted process: %v (replayed %v), want a fresh run", err, idemkey.Replayed(trailer))
	}
	again, trailer, err := b.create(key, req)
	if err != nil || !proto.Equal(again, charge) || !idemkey.Replayed(trailer) {
		t.Errorf("second retry: %v, %v (replayed %v); want the replay", again, err, idemkey.Replayed(trailer))
	}
	if n := count(t, pool, "charges"); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
}

func count(t *testing.T, pool *pgxpool.Pool, table string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

var (
	built    sync.Once
	builtBin string
	buildErr error
)

// buildServer builds the server binary once per test binary; TestMain
// deletes it.
func buildServer(t *testing.T) string {
	t.Helper()
	built.Do(func() {
		dir, err := os.MkdirTemp("", "idemkey-server")
		if err != nil {
			buildErr = err
			return
		}
		builtBin = filepath.Join(dir, "server")
		if out, err := exec.Command("go", "build", "-o", builtBin, ".").CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBin
}

// server is an example server process.
type server struct {
	cmd  *exec.Cmd
	conn *grpc.ClientConn
	done chan struct{}
}

// startServer starts the server binary on a free loopback port, with args
// added to its flags, and waits until it listens. It is killed when the test
// ends, if not before.
func startServer(t *testing.T, bin, url string, args ...string) *server {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0", "-database-url", url}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &server{cmd: cmd, done: make(chan struct{})}
	addrc := make(chan string, 1)
	go func() {
		defer close(s.done)
		lines := bufio.NewScanner(stderr)
		for lines.Scan() {
			line := lines.Text() // msg="payment service listening" addr=127.0.0.1:port ...
			if _, rest, ok := strings.Cut(line, " addr="); ok && strings.Contains(line, "payment service listening") {
				addr, _, _ := strings.Cut(rest, " ")
				addrc <- addr
			}
		}
		_ = cmd.Wait()
	}()
	t.Cleanup(s.kill)
	select {
	case addr := <-addrc:
		if s.conn, err = grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.conn.Close() })
	case <-s.done:
		t.Fatal("the server exited before it listened")
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not listen within 30s")
	}
	return s
}

func (s *server) create(key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, metadata.MD, error) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
	var trailer metadata.MD
	charge, err := paymentsv1.NewPaymentServiceClient(s.conn).CreateCharge(ctx, req, grpc.Trailer(&trailer))
	return charge, trailer, err
}

// kill sends SIGKILL and waits for the process to be gone.
func (s *server) kill() {
	_ = s.cmd.Process.Kill()
	<-s.done
}
