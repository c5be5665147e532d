package main

import (
	"bufio"
	"context"
	"log/slog"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	goleak.VerifyTestMain(m)
}

// The server creates its tables on an empty database, answers over loopback,
// stops on its context, and a second run on the same database replays the
// first run's reply.
func TestRunOnPostgres(t *testing.T) {
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
		go func() { done <- run(ctx, lis, url, 0, time.Hour, slog.New(slog.DiscardHandler)) }()
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
// gets A's reply, and the reply survives both processes being killed.
func TestProcessesOnOneDatabase(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "server")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	schema := pgtest.Schema(t)
	url := pgtest.SchemaURL(schema)
	a := startServer(t, bin, url, "2s")
	b := startServer(t, bin, url, "0s")
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
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM charges`).Scan(&n); err == nil && n == 1 {
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
	wantReplay(startServer(t, bin, url, "0s"), "a new process after both were killed")
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM charges`).Scan(&n); err != nil || n != 1 {
		t.Errorf("%d charges in the database (%v), want 1", n, err)
	}
}

// server is an example server process.
type server struct {
	cmd  *exec.Cmd
	conn *grpc.ClientConn
	done chan struct{}
}

// startServer starts the server binary on a free loopback port and waits until
// it listens. It is killed when the test ends, if not before.
func startServer(t *testing.T, bin, url, delay string) *server {
	t.Helper()
	cmd := exec.Command(bin, "-addr", "127.0.0.1:0", "-database-url", url, "-handler-delay", delay)
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
	if s.conn != nil {
		s.conn.Close()
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}
