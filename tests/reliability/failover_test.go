package reliability_test

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"

	"github.com/idemkey/idemkey/internal/servertest"
)

var (
	failovers      = flag.Int("failovers", 1, "fail the primary over this many times per topology in TestFailover (make failover-soak)")
	failoverReport = flag.String("failover-report", "", "write TestFailover's results as a Markdown table to this file")
)

// node is one PostgreSQL server of a topology.
type node struct {
	name string // its data directory's, under the topology's directory
	port int
}

// topology is a primary and a standby streaming from it, on free loopback
// ports, made by the test from the local server binaries: initdb, then
// pg_basebackup. With sync, the primary waits for the standby to flush every
// commit (synchronous_standby_names '*', synchronous_commit on). Its
// connection string names both nodes with target_session_attrs=read-write, as
// a client of a failover pair does, so that new connections find the
// primary.
type topology struct {
	*cluster
	t       *testing.T
	sync    bool
	nodes   [2]node
	primary int // index in nodes
}

// initdbOnce makes, in a directory of t's, an empty cluster that each
// topology copies for its primary: initdb costs seconds of CPU.
func initdbOnce(t *testing.T) (template string) {
	t.Helper()
	c := &cluster{dir: serverDir(t, "idemkey-template.")}
	if err := c.run("initdb", "-D", c.data(), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"); err != nil {
		t.Fatal(err)
	}
	return c.data()
}

func startTopology(t *testing.T, template string, synchronous bool) *topology {
	t.Helper()
	dir := serverDir(t, "idemkey-failover.")
	top := &topology{cluster: &cluster{dir: dir}, t: t, sync: synchronous}
	for i := range top.nodes {
		top.nodes[i] = node{name: fmt.Sprint("node", i), port: freePort(t)}
	}
	a, b := top.nodes[0], top.nodes[1]
	top.conn = fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=test sslmode=disable target_session_attrs=read-write connect_timeout=2", a.port, b.port)
	t.Cleanup(func() {
		if t.Failed() { // what PostgreSQL said, before the directory goes
			for _, n := range top.nodes {
				out, _ := os.ReadFile(top.data(n) + ".log")
				lines := strings.Split(string(out), "\n")
				t.Logf("the last lines of %s's log:\n%s", n.name, strings.Join(lines[max(0, len(lines)-40):], "\n"))
			}
		}
		if top.admin != nil {
			top.admin.Close()
		}
		for _, n := range top.nodes {
			_ = top.run("pg_ctl", "-D", top.data(n), "-w", "-s", "-m", "immediate", "stop")
		}
	})
	// As root, cp keeps the files the user postgres's.
	if out, err := exec.Command("cp", "-a", template, top.data(a)).CombinedOutput(); err != nil {
		t.Fatalf("copy the template cluster: %v\n%s", err, out)
	}
	top.startNode(a)
	if err := top.run("createdb", "-h", "127.0.0.1", "-p", fmt.Sprint(a.port), "-U", "postgres", "test"); err != nil {
		t.Fatal(err)
	}
	top.attachStandby(b)
	var err error
	if top.admin, err = pgxpool.New(context.Background(), top.dsn("application_name=idemkey-harness")); err != nil {
		t.Fatal(err)
	}
	return top
}

func (top *topology) data(n node) string { return filepath.Join(top.dir, n.name) }

// startNode starts n. fsync is off, as in the fault harness: what is tested
// is a standby taking over from a primary whose process died, not a machine
// losing its disk cache.
func (top *topology) startNode(n node) {
	top.t.Helper()
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -c port=%d -c unix_socket_directories=%s -c fsync=off -c max_connections=300", n.port, top.dir)
	if err := top.run("pg_ctl", "-D", top.data(n), "-l", top.data(n)+".log", "-w", "-s", "-o", opts, "start"); err != nil {
		top.t.Fatal(err)
	}
}

// setting returns the value of a setting on node n.
func (top *topology) setting(n node, name string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=test sslmode=disable", n.port))
	if err != nil {
		top.t.Fatal(err)
	}
	defer conn.Close(ctx)
	var v string
	if err := conn.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&v); err != nil {
		top.t.Fatal(err)
	}
	return v
}

// exec runs sql on node n alone.
func (top *topology) exec(n node, sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a loaded machine is slow
	defer cancel()
	conn, err := pgx.Connect(ctx, fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=test sslmode=disable", n.port))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// attachStandby makes n, whose data directory is gone, a standby of the
// primary (pg_basebackup), starts it, makes it synchronous if the topology
// is, and waits until the primary streams to it.
func (top *topology) attachStandby(n node) {
	t := top.t
	t.Helper()
	primary := top.nodes[top.primary]
	if err := top.run("pg_basebackup", "-h", "127.0.0.1", "-p", fmt.Sprint(primary.port), "-U", "postgres",
		"-D", top.data(n), "-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		t.Fatal(err)
	}
	// The copy has the primary's synchronous_standby_names: without it, the
	// standby, once promoted, runs alone rather than wait for a standby of
	// its own, as a failover manager would set it.
	auto := filepath.Join(top.data(n), "postgresql.auto.conf")
	conf, err := os.ReadFile(auto)
	if err != nil {
		t.Fatal(err)
	}
	lines := slices.DeleteFunc(strings.Split(string(conf), "\n"), func(l string) bool {
		return strings.HasPrefix(l, "synchronous_standby_names")
	})
	if err := os.WriteFile(auto, []byte(strings.Join(lines, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	top.startNode(n)
	if top.sync {
		for _, sql := range []string{`ALTER SYSTEM SET synchronous_standby_names = '*'`, `SELECT pg_reload_conf()`} {
			if err := top.exec(primary, sql); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := map[bool]string{true: "sync", false: "async"}[top.sync]
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		conn, err := pgx.Connect(ctx, fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=test sslmode=disable", primary.port))
		var state string
		if err == nil {
			err = conn.QueryRow(ctx, `SELECT coalesce(max(sync_state), '') FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&state)
			conn.Close(ctx)
		}
		cancel()
		if err == nil && state == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby is not streaming %s after a minute (%q, %v)", want, state, err)
		}
	}
}

// failover kills the primary (an immediate shutdown: its process dies, as in
// a crash) and promotes the standby, which runs alone. It returns when the
// primary was killed, and how long from then until the standby was promoted.
func (top *topology) failover() (killed time.Time, promoted time.Duration) {
	t := top.t
	t.Helper()
	old, next := top.nodes[top.primary], top.nodes[1-top.primary]
	killed = time.Now()
	if err := top.run("pg_ctl", "-D", top.data(old), "-w", "-s", "-m", "immediate", "stop"); err != nil {
		t.Fatal(err)
	}
	if err := top.run("pg_ctl", "-D", top.data(next), "-w", "-s", "promote"); err != nil {
		t.Fatal(err)
	}
	promoted = time.Since(killed)
	top.primary = 1 - top.primary
	if names := top.setting(next, "synchronous_standby_names"); names != "" {
		t.Errorf("the promoted standby waits for a standby of its own: synchronous_standby_names = %q", names)
	}
	top.admin.Reset() // its connections died with the old primary
	return killed, promoted
}

// rebuild makes the old primary a standby of the new one.
func (top *topology) rebuild() {
	old := top.nodes[1-top.primary]
	if err := os.RemoveAll(top.data(old)); err != nil {
		top.t.Fatal(err)
	}
	top.attachStandby(old)
}

func freePort(t *testing.T) int {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().(*net.TCPAddr).Port
}

// failoverResult is one mode's count on one topology.
type failoverResult struct {
	sync, atomic bool
	failovers    int
	v            *verdict
	lost         int           // ops whose OK reply a later replay did not repeat
	promoted     time.Duration // the slowest, from the kill
	recovered    time.Duration // the slowest, from the kill until every server answered OK
}

// TestFailover runs example server processes, atomic and two-phase, on a
// primary with a standby, under many clients, kills the primary and promotes
// the standby (with -failovers=N, N times, the old primary rebuilt as the
// new standby in between), then checks every reply: first with a
// synchronous standby, where nothing acknowledged may be lost, then with an
// asynchronous one, where the test counts what is lost.
func TestFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("the failover test takes half a minute")
	}
	var (
		mu       sync.Mutex
		results  []failoverResult
		template = initdbOnce(t)
	)
	t.Run("topologies", func(t *testing.T) {
		for _, synchronous := range []bool{true, false} {
			t.Run(map[bool]string{true: "sync", false: "async"}[synchronous], func(t *testing.T) {
				t.Parallel() // most of the time is waiting: for leases to end, for PostgreSQL
				rs := runFailover(t, template, synchronous)
				mu.Lock()
				defer mu.Unlock()
				results = append(results, rs...)
			})
		}
	})
	slices.SortFunc(results, func(a, b failoverResult) int {
		return cmp.Or(-cmp.Compare(b2i(a.sync), b2i(b.sync)), -cmp.Compare(b2i(a.atomic), b2i(b.atomic)))
	})
	t.Log("\n" + failoverTable(results))
	if *failoverReport != "" {
		if err := os.WriteFile(*failoverReport, []byte(failoverTable(results)), 0o644); err != nil {
			t.Error(err)
		}
	}
}

func runFailover(t *testing.T, template string, synchronous bool) []failoverResult {
	began := time.Now()
	top := startTopology(t, template, synchronous)
	t.Logf("topology up in %v", time.Since(began).Round(time.Millisecond))
	bin := servertest.Build(t)
	hs := []*harness{
		{t: t, cluster: top.cluster, bin: bin, atomic: true},
		{t: t, cluster: top.cluster, bin: bin, atomic: false},
	}
	for _, h := range hs {
		for i := range servers {
			h.setServer(i, h.startServer(i))
		}
	}
	t.Logf("servers up at %v", time.Since(began).Round(time.Millisecond))
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for j, h := range hs {
		for w := range workers / 2 {
			wg.Go(func() { h.work(ctx, uint64(100*j+w)) })
		}
	}
	results := make([]failoverResult, len(hs))
	for j, h := range hs {
		results[j] = failoverResult{sync: synchronous, atomic: h.atomic, failovers: *failovers}
	}
	time.Sleep(1500 * time.Millisecond)
	for round := range *failovers {
		if round > 0 {
			top.rebuild()
			time.Sleep(time.Second)
		}
		killed, promoted := top.failover()
		var (
			recovered [2]time.Duration
			probes    sync.WaitGroup
		)
		for j, h := range hs {
			probes.Go(func() { h.recoveryTime(); recovered[j] = time.Since(killed) })
		}
		probes.Wait()
		for j := range hs {
			results[j].promoted = max(results[j].promoted, promoted)
			results[j].recovered = max(results[j].recovered, recovered[j])
		}
		t.Logf("failover %d: the standby was promoted %v after the kill; every server answered OK after %v (atomic), %v (two-phase)",
			round+1, promoted.Round(time.Millisecond), recovered[0].Round(time.Millisecond), recovered[1].Round(time.Millisecond))
		time.Sleep(time.Second)
	}
	stop()
	wg.Wait()
	t.Logf("load stopped at %v", time.Since(began).Round(time.Millisecond))
	for _, h := range hs {
		wg.Go(func() { h.settle(); h.replayAll() })
	}
	wg.Wait()
	t.Logf("settled at %v", time.Since(began).Round(time.Millisecond))

	for j, h := range hs {
		if err := h.history.load(context.Background(), top.cluster); err != nil {
			t.Fatal(err)
		}
		v := &verdict{atomic: h.atomic}
		h.history.check(v)
		results[j].v, results[j].lost = v, h.history.lost()
		mode := map[bool]string{true: "atomic", false: "two-phase"}[h.atomic]
		switch {
		case synchronous:
			for _, p := range v.problems {
				t.Errorf("%s: %s", mode, p)
			}
			if results[j].lost > 0 {
				t.Errorf("%s: %d recorded replies lost with a synchronous standby", mode, results[j].lost)
			}
		default: // an asynchronous standby may lose what it had not received
			for _, p := range v.problems {
				t.Logf("%s: %s", mode, p)
			}
			if v.crossTenant > 0 || v.unfinished > 0 || v.stuck > 0 {
				t.Errorf("%s: %d cross-tenant replies, %d unfinished ops, %d records stuck", mode, v.crossTenant, v.unfinished, v.stuck)
			}
		}
		h.checkNothingRaw(t)
		if results[j].recovered > 30*time.Second {
			t.Errorf("%s: the servers took %v to answer OK after the failover", mode, results[j].recovered)
		}
	}
	return results
}

// replayAll sends every op that got an OK reply once more, until it gets a
// final reply, so that a reply lost with its record shows as a divergent one.
func (h *harness) replayAll() {
	var todo []*op
	for _, o := range h.history.all() {
		if gotOK(o) {
			todo = append(todo, o)
		}
	}
	var wg sync.WaitGroup
	next := make(chan *op)
	for w := range workers {
		wg.Go(func() {
			for o := range next {
				for attempt := 0; attempt < 20; attempt++ {
					if r := h.call(o, (w+attempt)%servers, callTimeout); r.final() {
						break
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		})
	}
	for _, o := range todo {
		next <- o
	}
	close(next)
	wg.Wait()
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func gotOK(o *op) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, r := range o.replies {
		if r.code == codes.OK {
			return true
		}
	}
	return false
}

// lost counts the ops that got an OK reply which a later reply did not
// repeat, or which names a charge the database no longer holds: the replies
// whose record was lost.
func (h *history) lost() int {
	n := 0
	for _, o := range h.all() {
		o.mu.Lock()
		ids := map[string]bool{}
		gone := false
		for _, r := range o.replies {
			if r.code == codes.OK {
				ids[r.charge.GetId()] = true
				_, held := h.ids[r.charge.GetId()]
				gone = gone || !held
			}
		}
		o.mu.Unlock()
		if len(ids) > 1 || gone {
			n++
		}
	}
	return n
}

// failoverTable renders results as the Markdown table of RELIABILITY.md.
func failoverTable(rs []failoverResult) string {
	var b strings.Builder
	b.WriteString("| standby | mode | failovers | requests | ops | double executions (outside the lease window) | recorded replies lost | unfinished ops | calls failed closed | standby promoted after | every server OK after |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		if r.v == nil {
			continue
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d (%d) | %d | %d | %d | %v | %v |\n",
			map[bool]string{true: "synchronous", false: "asynchronous"}[r.sync], map[bool]string{true: "atomic", false: "two-phase"}[r.atomic],
			r.failovers, r.v.requests, r.v.ops, r.v.duplicates, r.v.outsideWindow, r.lost, r.v.unfinished, r.v.failedClosed,
			r.promoted.Round(time.Millisecond), r.recovered.Round(time.Millisecond))
	}
	return b.String()
}
