// Command load drives the example payment server on PostgreSQL with ghz, a
// gRPC load tool (pinned in tools/ghz, a module of its own because it needs
// an older grpc-go than the other tools), over loopback, and runs pgbench
// with the minimal SQL of the same work on the same database as the
// database's own ceiling. make load runs it and prints its table.
//
//	go run ./internal/load [-duration 10s] [-clients 16] [-profile-dir DIR]
//
// For each mode (atomic, two-phase) it starts one server process on a schema
// of its own and measures four mixes: every call a new key, every call a
// replay of one key, the same marked as a later attempt of gRPC's retry
// policy (grpc-previous-rpc-attempts), and a storm (every call one of 62
// keys). ghz gives throughput, p50 and p99, and the status codes; pgbench
// gives the transactions per second of the SQL a new key costs, without gRPC
// or Go.
//
// Load tool, server and PostgreSQL share the machine's CPUs, so each run also
// reports the CPU time spent per call, read from /proc: the server's, the
// load tool's, and the rest of the machine's, which is PostgreSQL's as
// nothing else runs. From these it states how many new keys per second the
// CPUs would allow if PostgreSQL spent no more per call than under pgbench.
// It also reports the server process's peak resident memory, and with
// -profile-dir writes the server's CPU profile of each new-key run; the
// profiler, sampling 100 times a second, is part of what that run measures.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
)

func main() {
	duration := flag.Duration("duration", 10*time.Second, "how long each measurement runs")
	clients := flag.Int("clients", 16, "concurrent clients of ghz and of pgbench")
	profileDir := flag.String("profile-dir", "", "if set, write the server's CPU profile of each mode's new-key run here")
	flag.Parse()
	if err := run(*duration, *clients, *profileDir); err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
}

func run(duration time.Duration, clients int, profileDir string) error {
	dir, err := os.MkdirTemp("", "idemkey-load.")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin, err := servertest.Compile(dir)
	if err != nil {
		return err
	}
	ghzBin, err := buildGhz(dir)
	if err != nil {
		return err
	}
	fmt.Printf("%d clients, %v per measurement, %d CPUs; PostgreSQL at the test database URL\n\n", clients, duration, runtime.NumCPU())
	fmt.Println("| mode | run | calls/s | p50 | p99 | status codes | / ceiling | CPU per call: server | load tool | PostgreSQL and the rest | idle | server peak RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|")
	var notes []string
	for _, atomic := range []bool{true, false} {
		more, err := measureMode(bin, ghzBin, atomic, duration, clients, profileDir)
		if err != nil {
			return err
		}
		notes = append(notes, more...)
	}
	fmt.Println()
	for _, note := range notes {
		fmt.Println("-", note)
	}
	return nil
}

// measureMode prints the table's rows of one mode, and returns the notes to
// print under it: the capacity the CPU allows, and each error ghz counted.
func measureMode(bin, ghzBin string, atomic bool, duration time.Duration, clients int, profileDir string) (notes []string, err error) {
	schema, err := pgtest.CreateSchema()
	if err != nil {
		return nil, err
	}
	defer pgtest.DropSchema(schema)
	// The server creates its tables at start-up, pgbench's too.
	srv, err := servertest.Launch(bin, "-database-url", pgtest.SchemaURL(schema, fmt.Sprint("pool_max_conns=", clients+4)),
		fmt.Sprint("-atomic=", atomic), "-pprof-addr", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer srv.Kill()
	mode := "two-phase"
	if atomic {
		mode = "atomic"
	}
	ceiling, pg, err := pgbench(schema, srv.Pid(), atomic, duration, clients)
	if err != nil {
		return nil, err
	}
	fmt.Printf("| %s | pgbench: the SQL of a new key | %.0f | | | | 1 | | %s | %s | %s | |\n", mode, ceiling,
		perCall(pg.client, pg.n), perCall(pg.rest(), pg.n), pg.idleShare())

	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	for _, mix := range []struct {
		name, key string
		retry     bool // sent as a later attempt of gRPC's retry policy
	}{
		{"new key every call", "{{newUUID}}", false},
		{"replay of one key", "replay-" + run, false},
		{"replay of one key, as a retry", "replay-" + run, true},
		{"storm: 62 keys", "storm-" + run + "-{{randomString 1}}", false},
	} {
		newKeys := strings.HasPrefix(mix.name, "new key")
		profile := ""
		if newKeys && profileDir != "" {
			profile = filepath.Join(profileDir, "load-"+mode+".pprof")
		}
		r, u, err := ghz(ghzBin, srv, mix.key, mix.retry, duration, clients, profile)
		if err != nil {
			return nil, err
		}
		ratio := ""
		if newKeys {
			ratio = fmt.Sprintf("%.2f", r.RPS/ceiling)
			notes = append(notes, capacity(mode, u, pg, ceiling))
		}
		fmt.Printf("| %s | %s | %.0f | %v | %v | %s | %s | %s | %s | %s | %s | %s |\n", mode, mix.name, r.RPS,
			r.percentile(50), r.percentile(99), r.codes(), ratio,
			perCall(u.server, u.n), perCall(u.client, u.n), perCall(u.rest(), u.n), u.idleShare(), peakRSS(srv.Pid()))
		for msg, n := range r.Errors {
			notes = append(notes, fmt.Sprintf("%s, %s: %d × %s", mode, mix.name, n, msg))
		}
	}
	return notes, nil
}

// capacity says what the CPU alone allows on this machine: the calls per
// second of new keys if PostgreSQL spent no more per call than under
// pgbench, with the server's and ghz's CPU per call as measured.
func capacity(mode string, calls, pg usage, ceiling float64) string {
	each := func(d time.Duration, n int64) float64 { return float64(d) / float64(n) }
	cpu := each(pg.rest(), pg.n) + each(calls.server+calls.client, calls.n)
	most := float64(runtime.NumCPU()) * float64(time.Second) / cpu
	return fmt.Sprintf("%s, new keys: PostgreSQL and the rest spent %.0f µs of CPU per call, against %.0f µs per pgbench transaction. "+
		"Had they spent only pgbench's, a call would still cost %.0f µs of CPU with the server's and ghz's %.0f µs, "+
		"which caps %d CPUs at %.0f calls/s: %.2f × the ceiling.",
		mode, each(calls.rest(), calls.n)/1e3, each(pg.rest(), pg.n)/1e3, cpu/1e3,
		each(calls.server+calls.client, calls.n)/1e3, runtime.NumCPU(), most, most/ceiling)
}

// buildGhz builds ghz, pinned in tools/ghz, into dir, so that it runs
// without the go command around it, whose own CPU would count as ghz's.
func buildGhz(dir string) (string, error) {
	bin := filepath.Join(dir, "ghz")
	out, err := exec.Command("go", "build", "-modfile=tools/ghz/go.mod", "-o", bin, "github.com/bojand/ghz/cmd/ghz").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building ghz: %v\n%s", err, out)
	}
	return bin, nil
}

// usage is the CPU time spent while a load ran, over all CPUs: by the
// server, by the load tool (ghz or pgbench), and by the machine in all, the
// remainder of which is PostgreSQL's, as nothing else runs.
type usage struct {
	n              int64 // calls or transactions
	server, client time.Duration
	busy, idle     time.Duration
}

func (u usage) rest() time.Duration { return u.busy - u.server - u.client }

func (u usage) idleShare() string {
	return fmt.Sprintf("%.0f%%", 100*float64(u.idle)/float64(u.idle+u.busy))
}

// measure runs load, which returns its count of calls and its own CPU
// time, and returns what it used.
func measure(serverPid int, load func() (n int64, client time.Duration, err error)) (usage, error) {
	busy0, idle0 := machineCPU()
	server0 := processCPU(serverPid)
	n, client, err := load()
	busy1, idle1 := machineCPU()
	return usage{n: n, client: client, server: processCPU(serverPid) - server0, busy: busy1 - busy0, idle: idle1 - idle0}, err
}

// clockTick is the unit of /proc's CPU times: USER_HZ, 100 on Linux.
const clockTick = 10 * time.Millisecond

// processCPU is the user and system time a process has spent, from /proc.
func processCPU(pid int) time.Duration {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command's closing parenthesis; utime and stime are
	// the 14th and 15th of the whole line.
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * clockTick
}

// machineCPU is the time all CPUs have spent busy and idle (iowait counted
// as idle), from /proc/stat.
func machineCPU() (busy, idle time.Duration) {
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	for i, field := range strings.Fields(line)[1:] {
		ticks, _ := strconv.ParseInt(field, 10, 64)
		switch i {
		case 3, 4: // idle, iowait
			idle += time.Duration(ticks) * clockTick
		case 0, 1, 2, 5, 6, 7: // user, nice, system, irq, softirq, steal
			busy += time.Duration(ticks) * clockTick
		}
	}
	return busy, idle
}

func perCall(d time.Duration, n int64) string {
	if n == 0 {
		return "?"
	}
	return fmt.Sprintf("%.0f µs", float64(d)/float64(n)/float64(time.Microsecond))
}

// peakRSS is a process's peak resident memory, from /proc.
func peakRSS(pid int) string {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// report is the part of ghz's JSON output that the table shows.
type report struct {
	Count        int64   `json:"count"`
	RPS          float64 `json:"rps"`
	Distribution []struct {
		Percentage int           `json:"percentage"`
		Latency    time.Duration `json:"latency"`
	} `json:"latencyDistribution"`
	StatusCodes map[string]int `json:"statusCodeDistribution"`
	Errors      map[string]int `json:"errorDistribution"`
}

func (r report) percentile(p int) time.Duration {
	for _, d := range r.Distribution {
		if d.Percentage == p {
			return d.Latency.Round(10 * time.Microsecond)
		}
	}
	return 0
}

func (r report) codes() string {
	var parts []string
	for code, n := range r.StatusCodes {
		parts = append(parts, fmt.Sprintf("%s %d", code, n))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// ghz runs ghz against srv for duration, every call with the key template
// key, marked as a later attempt of a retry policy if retry is set, and
// parses its JSON report. If profile is set, it also writes the server's CPU
// profile of the run there.
func ghz(bin string, srv *servertest.Server, key string, retry bool, duration time.Duration, clients int, profile string) (report, usage, error) {
	md := map[string]string{"authorization": "Bearer sk_test_acme", idemkey.KeyMetadata: key}
	if retry {
		md[idemkey.AttemptsMetadata] = "1"
	}
	metadata, err := json.Marshal(md)
	if err != nil {
		return report{}, usage{}, err
	}
	cmd := exec.Command(bin, "--insecure",
		"--call", "example.payments.v1.PaymentService.CreateCharge",
		"-d", `{"customer_id": "cus_1", "amount": 100, "currency": "EUR"}`,
		"-m", string(metadata),
		"-c", strconv.Itoa(clients), "-z", duration.String(),
		"--count-errors", "-O", "json", srv.Addr,
		// At the end of the duration, let the calls in flight finish rather
		// than close the connection under them (ghz's default, "close",
		// fails each with Unavailable "transport is closing").
		"--duration-stop", "wait")
	profiled := make(chan error, 1)
	if profile != "" {
		go func() { profiled <- saveProfile(srv, profile, duration-time.Second) }()
	} else {
		profiled <- nil
	}
	var (
		r   report
		out []byte
	)
	u, err := measure(srv.Pid(), func() (int64, time.Duration, error) {
		var err error
		out, err = cmd.Output()
		if err != nil {
			return 0, 0, fmt.Errorf("ghz: %v\n%s", err, out)
		}
		if err := json.Unmarshal(out, &r); err != nil {
			return 0, 0, fmt.Errorf("ghz's report: %v", err)
		}
		return r.Count, cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime(), nil
	})
	if perr := <-profiled; err == nil {
		err = perr
	}
	return r, u, err
}

// saveProfile writes the server's CPU profile over the next d to path.
func saveProfile(srv *servertest.Server, path string, d time.Duration) error {
	addr := ""
	for _, line := range strings.Split(srv.Logs(), "\n") {
		if _, rest, ok := strings.Cut(line, " addr="); ok && strings.Contains(line, "pprof listening") {
			addr, _, _ = strings.Cut(rest, " ")
		}
	}
	if addr == "" {
		return errors.New("the server logged no pprof address")
	}
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, max(1, int(d.Seconds()))))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pprof: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// pgbench runs, with the same number of clients, the minimal SQL a new key
// costs in the mode, and returns its transactions per second and what it
// used. Two-phase: the reservation and the record, each a transaction,
// around the charge's insert. Atomic: all three in one transaction.
func pgbench(schema string, serverPid int, atomic bool, duration time.Duration, clients int) (float64, usage, error) {
	const (
		reserve = `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
  VALUES (sha256(uuid_send(gen_random_uuid())), '\x0000000000000000000000000000000000000000000000000000000000000000', 'in_progress',
    nextval('idempotency_keys_token_seq'), now() + interval '1 minute', now(), now() + interval '1 day')
  ON CONFLICT DO NOTHING RETURNING key AS k, token AS tok \gset`
		charge = `INSERT INTO charges (tenant, id, customer_id, amount, currency, description, create_time)
  VALUES ('acme', md5(random()::text), 'cus_1', 100, 'EUR', '', now());`
		record = `UPDATE idempotency_keys SET state = 'completed', outcome = '\x0a0a0a' WHERE key = :k AND token = :tok;`
	)
	script := reserve + "\n" + charge + "\n" + record + "\n"
	if atomic {
		script = "BEGIN;\n" + script + "COMMIT;\n"
	}
	f, err := os.CreateTemp("", "idemkey-load-*.sql")
	if err != nil {
		return 0, usage{}, err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(script); err != nil {
		return 0, usage{}, err
	}
	f.Close()
	cmd := exec.Command(pgtest.ServerBinary("pgbench"), "-n", "-M", "prepared", "-f", f.Name(),
		"-c", strconv.Itoa(clients), "-j", "2", "-T", strconv.Itoa(int(duration.Seconds())), pgtest.URL())
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+schema)
	var tps float64
	u, err := measure(serverPid, func() (int64, time.Duration, error) {
		out, err := cmd.CombinedOutput()
		if err != nil {
			return 0, 0, fmt.Errorf("pgbench: %v\n%s", err, out)
		}
		tpsMatch := regexp.MustCompile(`tps = ([0-9.]+)`).FindSubmatch(out)
		nMatch := regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`).FindSubmatch(out)
		if tpsMatch == nil || nMatch == nil {
			return 0, 0, fmt.Errorf("pgbench printed no tps:\n%s", out)
		}
		tps, _ = strconv.ParseFloat(string(tpsMatch[1]), 64)
		n, _ := strconv.ParseInt(string(nMatch[1]), 10, 64)
		return n, cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime(), nil
	})
	return tps, u, err
}
