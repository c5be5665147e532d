// Package servertest runs the example payment server as a process of its own,
// for tests that kill and restart servers (the example server's own tests and
// the reliability harness) and for make load.
package servertest

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

var built struct {
	sync.Once
	bin string
	err error
}

// Build builds the example server once per test binary and returns the
// binary's path. Call Cleanup from TestMain to delete it.
func Build(tb testing.TB) string {
	tb.Helper()
	built.Do(func() {
		dir, err := os.MkdirTemp("", "idemkey-server.")
		if err != nil {
			built.err = err
			return
		}
		built.bin, built.err = Compile(dir)
	})
	if built.err != nil {
		tb.Fatal(built.err)
	}
	return built.bin
}

// Compile builds the example server into dir and returns the binary's path.
// It builds by directory, ./server in the repository's example directory,
// rather than by import path: that way the build needs no module to require
// the example's, whichever module's directory the caller runs in, as long as
// it is inside the repository.
func Compile(dir string) (string, error) {
	root, err := repoRoot()
	if err != nil {
		return "", err
	}
	bin, err := filepath.Abs(filepath.Join(dir, "server"))
	if err != nil {
		return "", err
	}
	cmd := exec.Command("go", "build", "-o", bin, "./server")
	cmd.Dir = filepath.Join(root, "example")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./server in %s: %v\n%s", cmd.Dir, err, out)
	}
	return bin, nil
}

// repoRoot returns the repository's root: the directory of module
// github.com/idemkey/idemkey, which every module of the repository requires
// (through the workspace, or its replace directive).
func repoRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemkey/idemkey").Output()
	if err != nil {
		return "", fmt.Errorf("go list -m github.com/idemkey/idemkey: %v", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// Cleanup deletes the binary Build made, if any.
func Cleanup() {
	if built.bin != "" {
		os.RemoveAll(filepath.Dir(built.bin))
	}
}

// Server is one running server process and, from Start, a client connection
// to it.
type Server struct {
	Addr string
	Conn *grpc.ClientConn

	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited
	logs lockedBuffer
}

// Start starts bin on a free loopback port with args added to its flags, and
// waits until it listens. The process is killed, and the connection closed,
// when tb ends.
func Start(tb testing.TB, bin string, args ...string) *Server {
	tb.Helper()
	s, err := Launch(bin, args...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = s.Kill() })
	if s.Conn, err = grpc.NewClient(s.Addr, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Conn.Close() })
	return s
}

// Launch is Start for a command rather than a test: it leaves the process
// to the caller to Kill, and makes no connection.
func Launch(bin string, args ...string) (*Server, error) {
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0"}, args...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Server{cmd: cmd, done: make(chan struct{})}
	addrc := make(chan string, 1)
	go func() {
		defer close(s.done)
		lines := bufio.NewScanner(stderr)
		lines.Buffer(nil, 1<<20)
		for lines.Scan() {
			line := lines.Text() // msg="payment service listening" addr=127.0.0.1:port ...
			s.logs.writeLine(line)
			if _, rest, ok := strings.Cut(line, " addr="); ok && strings.Contains(line, "payment service listening") {
				addr, _, _ := strings.Cut(rest, " ")
				addrc <- addr
			}
		}
		_ = cmd.Wait()
	}()
	select {
	case s.Addr = <-addrc:
		return s, nil
	case <-s.done:
		return nil, fmt.Errorf("the server exited before it listened:\n%s", s.Logs())
	case <-time.After(30 * time.Second):
		_ = s.Kill()
		return nil, fmt.Errorf("the server did not listen within 30s:\n%s", s.Logs())
	}
}

// Pid is the process's id.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// Kill sends SIGKILL and waits for the process to be gone. It reports an
// error unless SIGKILL is what ended the process.
func (s *Server) Kill() error {
	_ = s.cmd.Process.Kill()
	<-s.done // after cmd.Wait has set ProcessState
	if ws, ok := s.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		return fmt.Errorf("the server ended with %v, not by SIGKILL", s.cmd.ProcessState)
	}
	return nil
}

// Logs returns what the process has written to its standard error.
func (s *Server) Logs() string { return s.logs.String() }

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) writeLine(line string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.WriteString(line)
	b.buf.WriteByte('\n')
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
