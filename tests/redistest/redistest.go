// Package redistest starts throwaway redis-server processes for tests: a
// single server, a primary with a replica, and a Redis Cluster of three
// primaries and three replicas, each in a temporary directory on free ports,
// from the local redis-server (and redis-cli to form the cluster). Nothing
// is written to disk that outlives the test, and the machine's own Redis is
// never touched.
//
// Shared servers (URL, SharedCluster) start once per test binary and stop in
// Main. IDEMKEY_TEST_REDIS_URL names a server to use instead of starting
// one, for URL only. Where redis-server is missing a test skips, except in CI
// (CI=true), where it fails: CI must never pass by skipping.
package redistest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Server is one redis-server process.
type Server struct {
	Addr string
	dir  string
	args []string

	mu  sync.Mutex
	cmd *exec.Cmd
}

var (
	sharedMu      sync.Mutex
	sharedServers []*Server // stopped by Main
	shared        *Server
	sharedCluster *Cluster
)

// Main runs the tests and then stops the shared servers.
func Main(m *testing.M) {
	code := m.Run()
	sharedMu.Lock()
	for _, s := range sharedServers {
		s.Stop()
	}
	sharedMu.Unlock()
	os.Exit(code)
}

// binary returns the path of name (redis-server, redis-cli), or fails or
// skips t where it is not installed.
func binary(t testing.TB, name string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is not installed; CI needs it (Debian: apt-get install redis-server)", name)
	}
	t.Skipf("%s is not installed (Debian: apt-get install redis-server)", name)
	return ""
}

// freePort returns a port on 127.0.0.1 that is free, as is port+10000, a
// cluster node's bus port.
func freePort() (int, error) {
	for range 100 {
		port := 20000 + rand.IntN(20000)
		ok := true
		for _, p := range []int{port, port + 10000} {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			return port, nil
		}
	}
	return 0, errors.New("no free port pair found")
}

// Start starts a redis-server with args added to a configuration that keeps
// nothing on disk, stopped when t ends.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	s := start(t, args...)
	t.Cleanup(s.Stop)
	return s
}

func start(t testing.TB, args ...string) *Server {
	t.Helper()
	bin := binary(t, "redis-server")
	dir, err := os.MkdirTemp("", "idemkey-redis-")
	if err != nil {
		t.Fatal(err)
	}
	var lastErr error
	for range 5 {
		port, err := freePort()
		if err != nil {
			t.Fatal(err)
		}
		s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), dir: dir}
		s.args = append([]string{
			"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
			"--save", "", "--appendonly", "no", "--daemonize", "no",
			"--logfile", filepath.Join(dir, "redis.log"), "--maxmemory-policy", "noeviction",
			"--enable-debug-command", "local", "--repl-diskless-sync-delay", "0",
		}, args...)
		if lastErr = s.launch(bin); lastErr == nil {
			return s
		}
	}
	t.Fatalf("redis-server did not start: %v", lastErr)
	return nil
}

// launch runs the server and waits until it answers PING.
func (s *Server) launch(bin string) error {
	cmd := exec.Command(bin, s.args...)
	cmd.Dir = s.dir
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	// The server dies with the test binary, even one killed by a timeout.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: NoMaintNotifications(), Addr: s.Addr, MaxRetries: -1})
	defer c.Close()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		select {
		case <-exited:
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			return fmt.Errorf("redis-server exited: %s%s", stderr.String(), tail(log))
		default:
		}
		if c.Ping(context.Background()).Err() == nil {
			s.mu.Lock()
			s.cmd = cmd
			s.mu.Unlock()
			return nil
		}
	}
	cmd.Process.Kill()
	return errors.New("redis-server did not answer PING within 10s")
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// Kill stops the server with SIGKILL, as a crash would.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.cmd.Process.Kill()
		s.cmd.Process.Wait()
		s.cmd = nil
	}
}

// Restart starts a killed server again on the same address and directory
// (a cluster node keeps its identity there).
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	if err := s.launch(binary(t, "redis-server")); err != nil {
		t.Fatalf("restart %s: %v", s.Addr, err)
	}
}

// Stop kills the server and deletes its directory.
func (s *Server) Stop() {
	s.Kill()
	os.RemoveAll(s.dir)
}

// Client returns a client of the server, closed when t ends.
func (s *Server) Client(t testing.TB) *goredis.Client {
	c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: NoMaintNotifications(), Addr: s.Addr})
	t.Cleanup(func() { c.Close() })
	return c
}

// URL returns the URL of the shared test server: IDEMKEY_TEST_REDIS_URL if
// set, else a server started for this test binary.
func URL(t testing.TB) string {
	t.Helper()
	if u := os.Getenv("IDEMKEY_TEST_REDIS_URL"); u != "" {
		return u
	}
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if shared == nil {
		shared = start(t)
		sharedServers = append(sharedServers, shared)
	}
	return "redis://" + shared.Addr
}

// Client returns a client of the shared test server, closed when t ends.
func Client(t testing.TB) *goredis.Client {
	t.Helper()
	opts, err := goredis.ParseURL(URL(t))
	if err != nil {
		t.Fatalf("IDEMKEY_TEST_REDIS_URL: %v", err)
	}
	opts.MaintNotificationsConfig = NoMaintNotifications()
	c := goredis.NewClient(opts)
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("no Redis server answers at the test URL: %v", err)
	}
	return c
}

// Replicated starts a primary and one replica of it, stopped when t ends,
// and waits until the replica is in sync.
func Replicated(t testing.TB) (primary, replica *Server) {
	t.Helper()
	primary = Start(t)
	replica = Start(t, "--replicaof", "127.0.0.1", strings.TrimPrefix(primary.Addr, "127.0.0.1:"))
	c := primary.Client(t)
	waitFor(t, 10*time.Second, "the replica to connect", func() bool {
		info, err := c.Info(context.Background(), "replication").Result()
		return err == nil && strings.Contains(info, "connected_slaves:1") && strings.Contains(info, "state=online")
	})
	return primary, replica
}

func waitFor(t testing.TB, d time.Duration, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !ok(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
	}
}

// Signal sends sig to the server's process, such as SIGSTOP and SIGCONT to
// hold it still for a while.
func (s *Server) Signal(sig os.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		s.cmd.Process.Signal(sig)
	}
}

// NoMaintNotifications turns off go-redis's maintenance notifications,
// which Redis 7 lacks: in their default "auto" mode, go-redis v9.23 races on
// the connections the store's replica wait takes while it falls back
// (redis.WithReplicas).
func NoMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
