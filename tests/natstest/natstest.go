// Package natstest gives tests a real NATS server with JetStream: the shared
// one of the machine (IDEMKEY_TEST_NATS_URL, else nats://127.0.0.1:4222), on
// which each test makes a stream of its own, or a server of a test's own,
// which it may kill and restart. Where none answers, or nats-server is not
// installed, a test skips, except in CI (CI=true), where it fails.
package natstest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// URL is the shared test server's URL.
func URL() string {
	if u := os.Getenv("IDEMKEY_TEST_NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// Connect connects to the shared test server, closed when t ends.
func Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return connect(t, URL())
}

func connect(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no NATS server at %s (%v). CI needs one with JetStream: nats-server -a 127.0.0.1 -p 4222 -js -sd DIR", url, err)
		}
		t.Skipf("no NATS server at %s (%v)", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// Name returns a name no other test uses, for a stream or a subject.
func Name(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + "_" + hex.EncodeToString(b)
}

// Stream creates a stream from cfg, deleted when t ends; cfg.Name and
// cfg.Subjects are set to unique ones when empty.
func Stream(t testing.TB, js jetstream.JetStream, cfg jetstream.StreamConfig) jetstream.Stream {
	t.Helper()
	if cfg.Name == "" {
		cfg.Name = Name("T")
	}
	if len(cfg.Subjects) == 0 {
		cfg.Subjects = []string{cfg.Name + ".>"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatalf("create stream: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, cfg.Name); err != nil && !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Logf("delete stream: %v", err)
		}
	})
	return s
}

// Server is a nats-server of a test's own, with JetStream storing in a
// directory of its own.
type Server struct {
	URL  string
	port int
	dir  string
	mu   sync.Mutex
	cmd  *exec.Cmd
}

// Start starts a nats-server with JetStream on a free loopback port, stopped
// and its directory deleted when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin := binary(t)
	dir := t.TempDir()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{URL: "nats://127.0.0.1:" + strconv.Itoa(port), port: port, dir: dir}
	if err := s.launch(bin); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return s
}

// binary returns the path of nats-server (on the PATH, else Debian's
// /usr/sbin), or fails or skips t where it is not installed.
func binary(t testing.TB) string {
	t.Helper()
	if bin, err := exec.LookPath("nats-server"); err == nil {
		return bin
	}
	const debian = "/usr/sbin/nats-server"
	if _, err := os.Stat(debian); err == nil {
		return debian
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("nats-server is not installed; CI needs it (Debian: apt-get install nats-server)")
	}
	t.Skip("nats-server is not installed (Debian: apt-get install nats-server)")
	return ""
}

func (s *Server) launch(bin string) error {
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-js", "-sd", filepath.Join(s.dir, "js"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		select {
		case <-exited:
			return fmt.Errorf("nats-server exited: %s", out.String())
		default:
		}
		if nc, err := nats.Connect(s.URL); err == nil {
			nc.Close()
			s.mu.Lock()
			s.cmd = cmd
			s.mu.Unlock()
			return nil
		}
	}
	cmd.Process.Kill()
	return errors.New("nats-server did not accept connections within 10s")
}

// Connect connects to s, closed when t ends.
func (s *Server) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return connect(t, s.URL)
}

// Kill stops the server with SIGKILL, as a crash would; JetStream's data stays.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.cmd.Process.Kill()
		s.cmd.Process.Wait()
		s.cmd = nil
	}
}

// Restart starts a killed server again on the same port and data.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	if err := s.launch(binary(t)); err != nil {
		t.Fatalf("restart nats-server: %v", err)
	}
}
