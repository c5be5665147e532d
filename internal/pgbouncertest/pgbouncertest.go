// Package pgbouncertest runs a throwaway pgbouncer in transaction pooling
// mode in front of the test database of internal/pgtest, for tests of idemkey
// behind a pooler that keeps no session state and no prepared statements.
//
// pgbouncer comes from the PATH or /usr/sbin (Debian: apt-get install
// pgbouncer). Where it is missing a test skips, except in CI (CI=true), where
// it fails. pgbouncer refuses to run as root; as root, it runs as the user
// postgres, as the test database of scripts/with-postgres does.
package pgbouncertest

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkey/idemkey/internal/pgtest"
)

// Config is what a Bouncer sets up besides transaction pooling.
type Config struct {
	// Settings are SET on each server connection pgbouncer opens (its
	// connect_query), as a role's or a database's settings would be: a
	// transaction pooler does not carry a client's own session settings.
	// Values must not hold quotes.
	Settings map[string]string
	// PoolSize is the most server connections pgbouncer opens; 0 means 20,
	// pgbouncer's default.
	PoolSize int
}

// Bouncer is one running pgbouncer.
type Bouncer struct {
	Port     int
	user     string
	database string
	dir      string
	cmd      *exec.Cmd
	exited   chan struct{}
}

// Start starts pgbouncer on a free loopback port in front of the test
// database, in transaction pooling mode with trust authentication, and stops
// it when tb ends.
func Start(tb testing.TB, cfg Config) *Bouncer {
	tb.Helper()
	bin := binary()
	if bin == "" {
		msg := "no pgbouncer on the PATH or in /usr/sbin (Debian: apt-get install pgbouncer)"
		if os.Getenv("CI") == "true" {
			tb.Fatal(msg + "; CI needs it")
		}
		tb.Skip(msg)
	}
	target, err := pgconn.ParseConfig(pgtest.URL())
	if err != nil {
		tb.Fatalf("test database URL: %v", err)
	}
	dir, err := os.MkdirTemp("", "idemkey-pgbouncer.")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	b := &Bouncer{user: target.User, database: target.Database, dir: dir}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		if cred, err = serverUser(dir); err != nil {
			tb.Fatal(err)
		}
	}
	for attempt := 1; ; attempt++ {
		err = b.start(bin, target, cfg, cred)
		if err == nil || attempt == 5 {
			break
		}
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(b.stop)
	return b
}

// binary finds pgbouncer on the PATH, else where Debian puts it (/usr/sbin,
// which a user's PATH may lack).
func binary() string {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// serverUser makes dir the user postgres's and returns that user's
// credentials.
func serverUser(dir string) (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, errors.New("running as root, and there is no user postgres to run pgbouncer as (it refuses root)")
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// start writes the configuration for a free port and starts pgbouncer on it.
// Another process may take the port first: then pgbouncer exits, and start
// reports so, for Start to try another.
func (b *Bouncer) start(bin string, target *pgconn.Config, cfg Config, cred *syscall.Credential) error {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	b.Port = lis.Addr().(*net.TCPAddr).Port
	lis.Close()

	var query []string
	names := make([]string, 0, len(cfg.Settings))
	for name := range cfg.Settings {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		query = append(query, fmt.Sprintf(`SET %s TO "%s"`, name, cfg.Settings[name]))
	}
	server := fmt.Sprintf("host=%s port=%d dbname=%s user=%s", target.Host, target.Port, target.Database, target.User)
	if target.Password != "" {
		server += " password=" + target.Password
	}
	if len(query) > 0 {
		server += " connect_query='" + strings.Join(query, "; ") + "'"
	}
	poolSize := cfg.PoolSize
	if poolSize <= 0 {
		poolSize = 20
	}
	ini := fmt.Sprintf(`[databases]
%s = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
pidfile =
logfile = %s
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 1000
; the tests name their schema in the URL (pgtest.Pool); connect_query sets it
ignore_startup_parameters = search_path, extra_float_digits
`, b.database, server, b.Port, filepath.Join(b.dir, "pgbouncer.log"), filepath.Join(b.dir, "userlist.txt"), poolSize)
	files := map[string]string{
		"pgbouncer.ini": ini,
		"userlist.txt":  fmt.Sprintf("%q \"\"\n", target.User),
	}
	for name, content := range files {
		path := filepath.Join(b.dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			return err
		}
		if cred != nil {
			if err := os.Chown(path, int(cred.Uid), int(cred.Gid)); err != nil {
				return err
			}
		}
	}

	b.cmd = exec.Command(bin, filepath.Join(b.dir, "pgbouncer.ini"))
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if err := b.cmd.Start(); err != nil {
		return err
	}
	b.exited = make(chan struct{})
	go func() { _ = b.cmd.Wait(); close(b.exited) }()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		select {
		case <-b.exited:
			return fmt.Errorf("pgbouncer exited at start:\n%s", b.log())
		default:
		}
		if c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port))); err == nil {
			c.Close()
			return nil
		}
	}
	b.stop()
	return fmt.Errorf("pgbouncer did not listen within 10s:\n%s", b.log())
}

// stop shuts pgbouncer down at once (SIGTERM), closing its clients'
// connections, and waits for it to exit.
func (b *Bouncer) stop() {
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(5 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.exited
	}
}

func (b *Bouncer) log() string {
	out, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	return string(out)
}

// URL returns a connection string to the test database through pgbouncer,
// with the parameters params ("name=value") added, such as pgx's
// default_query_exec_mode=exec.
func (b *Bouncer) URL(params ...string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(b.user),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port)),
		Path:     "/" + b.database,
		RawQuery: strings.Join(append([]string{"sslmode=disable"}, params...), "&"),
	}
	return u.String()
}
