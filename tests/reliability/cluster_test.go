package reliability_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
)

// cluster is a PostgreSQL cluster the harness owns, so that it may crash and
// stop it: made by initdb from the local server binaries in a temporary
// directory, listening only on a Unix socket there. It never touches a shared
// server.
type cluster struct {
	dir   string
	conn  string        // the test database's connection string, without parameters
	admin *pgxpool.Pool // reconnects after restarts
}

func startCluster(t *testing.T) *cluster {
	t.Helper()
	dir := serverDir(t, "idemkey-faults.")
	c := &cluster{dir: dir, conn: "host=" + dir + " user=postgres dbname=test sslmode=disable"}
	t.Cleanup(func() {
		if c.admin != nil {
			c.admin.Close()
		}
		_ = c.pgctl("stop", "-m", "immediate")
	})
	if err := c.run("initdb", "-D", c.data(), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"); err != nil {
		t.Fatal(err)
	}
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	if err := c.run("createdb", "-h", dir, "-U", "postgres", "test"); err != nil {
		t.Fatal(err)
	}
	var err error
	if c.admin, err = pgxpool.New(context.Background(), c.dsn("application_name=idemkey-harness")); err != nil {
		t.Fatal(err)
	}
	return c
}

// serverDir makes a temporary directory that the PostgreSQL server binaries
// may write to (as root, they run as the user postgres, since PostgreSQL
// refuses root), removed when t ends. Without the binaries it skips t, or
// fails it in CI.
func serverDir(t *testing.T, pattern string) string {
	t.Helper()
	if pgtest.ServerBinary("initdb") == "" {
		msg := "no PostgreSQL server binaries (initdb, pg_ctl) to start a cluster of the harness's own; Debian: apt-get install postgresql"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	dir, err := os.MkdirTemp("", pattern)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatal("running as root, and there is no user postgres to run the cluster as")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func (c *cluster) data() string { return filepath.Join(c.dir, "data") }

// dsn is the connection string of the test database, with params
// ("name=value") added.
func (c *cluster) dsn(params ...string) string {
	return strings.Join(append([]string{c.conn}, params...), " ")
}

// run runs one of the server binaries as the user the cluster belongs to.
func (c *cluster) run(name string, args ...string) error {
	path := pgtest.ServerBinary(name)
	cmd := exec.Command(path, args...)
	if os.Geteuid() == 0 {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v\n%s", name, err, out)
	}
	return nil
}

func (c *cluster) pgctl(args ...string) error {
	return c.run("pg_ctl", append([]string{"-D", c.data(), "-w", "-s"}, args...)...)
}

// start starts the cluster (fsync off: it is deleted afterwards, and a crash
// of PostgreSQL alone, unlike one of the machine, loses nothing written).
func (c *cluster) start() error {
	return c.pgctl("-l", filepath.Join(c.dir, "server.log"),
		"-o", "-c listen_addresses='' -k "+c.dir+" -c fsync=off -c max_connections=300", "start")
}

// stop stops the cluster: mode "immediate" is a crash, "fast" a clean stop.
func (c *cluster) stop(mode string) error { return c.pgctl("-m", mode, "stop") }

// accepting reports whether the cluster accepts connections.
func (c *cluster) accepting() bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	return c.admin.Ping(ctx) == nil
}
