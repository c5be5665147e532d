// Command load measures what idemkey adds to a service under load: it drives
// the example payment server on PostgreSQL with ghz, a gRPC load tool
// (pinned in tools/ghz, a module of its own because it needs an older
// grpc-go than the other tools), over loopback, in four processes side by
// side: the bare service (-idempotency=false: the same service, handler and
// database, no interceptor, each charge an autocommitted INSERT), bare-tx
// (the same with -in-transaction: BEGIN, the INSERT, COMMIT, the round trips
// and the single commit of atomic mode, so its fair baseline), atomic mode
// and two-phase mode. pgbench runs
// the minimal SQL of a new key in each mode on the same database, the
// database's own ceiling. make load runs it and prints its tables.
//
//	go run ./tests/load [-duration 10s] [-rounds 5] [-clients 16] [-profile-dir DIR] [-json FILE]
//
// The measurements are interleaved: each round runs every measurement for
// duration/rounds, in an order that rotates from round to round, so that
// noise on a shared machine hits all alike. The mixes: every call a new key
// (bare, bare-tx, atomic, two-phase), and in each idemkey mode every call a replay of
// one key, the same marked as a later attempt of gRPC's retry policy
// (grpc-previous-rpc-attempts), and a storm (every call one of 62 keys).
//
// Load tool, servers and PostgreSQL share the machine's CPUs, so each
// measurement also reports the CPU time spent per call, from /proc: the
// server's, the load tool's, PostgreSQL's (every process of the cluster,
// backends that exited included), and the rest of the machine's. The ratios
// that the targets of BENCHMARKS.md name close the output; -json writes all
// of it for tests/chart. With -profile-dir it writes each server's CPU
// profile of its new-key run in every round, load-MODE-ROUND.pprof, which
// go tool pprof merges when given them all; the profiler, sampling 100 times
// a second, is part of what those runs measure.
package main

import (
	"bytes"
	"context"
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
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
)

func main() {
	duration := flag.Duration("duration", 10*time.Second, "how long each measurement runs in all, over the rounds")
	rounds := flag.Int("rounds", 5, "how many rounds the measurements are interleaved in")
	clients := flag.Int("clients", 16, "concurrent clients of ghz and of pgbench")
	profileDir := flag.String("profile-dir", "", "if set, write each server's CPU profile of its new-key run in every round here")
	jsonPath := flag.String("json", "", "if set, write the results as JSON here, for tests/chart")
	flag.Parse()
	res, err := run(*duration, *rounds, *clients, *profileDir)
	if err == nil && *jsonPath != "" {
		err = writeJSON(*jsonPath, res)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
}

// Results is what -json writes.
type Results struct {
	Date        time.Time `json:"date"`
	CPUs        int       `json:"cpus"`
	Clients     int       `json:"clients"`
	Rounds      int       `json:"rounds"`
	RunDuration string    `json:"run_duration"` // of each measurement in each round
	Rows        []Row     `json:"rows"`
	Ratios      []Ratio   `json:"ratios"`
}

// Row is one measurement, summed over its rounds.
type Row struct {
	Mode       string         `json:"mode"` // bare, bare-tx, atomic, two-phase
	Mix        string         `json:"mix"`  // new, replay, retry, storm, pgbench
	Calls      int64          `json:"calls"`
	PerSecond  float64        `json:"per_second"`
	RoundRates []float64      `json:"round_rates"`
	P50        float64        `json:"p50_us,omitempty"`
	P99        float64        `json:"p99_us,omitempty"`
	Codes      map[string]int `json:"codes,omitempty"`
	Errors     map[string]int `json:"errors,omitempty"`
	// CPU per call, in µs: the server's, the load tool's, PostgreSQL's, and
	// the rest of the machine's (the kernel's loopback work, other jobs).
	Server   float64 `json:"cpu_server_us"`
	Load     float64 `json:"cpu_load_us"`
	Postgres float64 `json:"cpu_postgres_us"`
	Rest     float64 `json:"cpu_rest_us"`
	Idle     float64 `json:"idle_share"`
	PeakRSS  string  `json:"server_peak_rss,omitempty"`

	u     usage
	wall  time.Duration
	lats  []time.Duration
	codes map[string]int
}

// Ratio is one of the ratios the targets name, over the whole run and the
// range of its values round by round.
type Ratio struct {
	Name   string  `json:"name"`
	Value  float64 `json:"value"`
	Min    float64 `json:"round_min"`
	Max    float64 `json:"round_max"`
	Target string  `json:"target"` // "<= 1.10", ">= 0.8", or "" for none
	Met    *bool   `json:"met,omitempty"`
}

// measurement is one row's load: it runs for d and adds to its row.
type measurement struct {
	row *Row
	run func(d time.Duration, profile string) error
	srv *servertest.Server // nil for pgbench
}

func run(duration time.Duration, rounds, clients int, profileDir string) (*Results, error) {
	rounds = max(rounds, 1)
	each := (duration / time.Duration(rounds)).Round(time.Second)
	if each < time.Second {
		each = time.Second // pgbench counts in whole seconds
	}
	dir, err := os.MkdirTemp("", "idemkey-load.")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin, err := servertest.Compile(dir)
	if err != nil {
		return nil, err
	}
	ghzBin, err := buildGhz(dir)
	if err != nil {
		return nil, err
	}
	cluster, err := findPostmaster()
	if err != nil {
		fmt.Fprintln(os.Stderr, "load: PostgreSQL's CPU is not measured:", err)
	}
	res := &Results{Date: time.Now().UTC(), CPUs: runtime.NumCPU(), Clients: clients, Rounds: rounds, RunDuration: each.String()}
	var ms []measurement
	add := func(mode, mix string, srv *servertest.Server, run func(d time.Duration, profile string, r *Row) error) {
		row := &Row{Mode: mode, Mix: mix, codes: map[string]int{}}
		ms = append(ms, measurement{row: row, srv: srv, run: func(d time.Duration, profile string) error {
			return run(d, profile, row)
		}})
	}
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	for _, mode := range []string{"bare", "bare-tx", "atomic", "two-phase"} {
		schema, err := pgtest.CreateSchema()
		if err != nil {
			return nil, err
		}
		defer pgtest.DropSchema(schema)
		args := []string{"-database-url", pgtest.SchemaURL(schema, fmt.Sprint("pool_max_conns=", clients+4)), "-pprof-addr", "127.0.0.1:0"}
		switch mode {
		case "bare":
			args = append(args, "-idempotency=false")
		case "bare-tx":
			args = append(args, "-idempotency=false", "-in-transaction")
		case "two-phase":
			args = append(args, "-atomic=false")
		}
		// The server creates its tables at start-up, pgbench's too.
		srv, err := servertest.Launch(bin, args...)
		if err != nil {
			return nil, err
		}
		defer srv.Kill()
		callMix := func(key string, retry bool) func(time.Duration, string, *Row) error {
			return func(d time.Duration, profile string, r *Row) error {
				return ghz(ghzBin, srv, cluster, key, retry, d, clients, profile, r)
			}
		}
		add(mode, "new", srv, callMix("{{newUUID}}", false))
		if mode == "bare" || mode == "bare-tx" {
			continue
		}
		add(mode, "pgbench", nil, func(d time.Duration, _ string, r *Row) error {
			return pgbench(schema, cluster, mode == "atomic", d, clients, r)
		})
		add(mode, "replay", srv, callMix("replay-"+tag, false))
		add(mode, "retry", srv, callMix("replay-"+tag, true))
		add(mode, "storm", srv, callMix("storm-"+tag+"-{{randomString 1}}", false))
	}
	fmt.Printf("%d clients, %d rounds of %v per measurement, %d CPUs; PostgreSQL at the test database URL\n", clients, rounds, each, runtime.NumCPU())
	for round := range rounds {
		for j := range ms {
			m := ms[(j+round)%len(ms)]
			profile := ""
			if profileDir != "" && m.row.Mix == "new" {
				profile = filepath.Join(profileDir, fmt.Sprintf("load-%s-%d.pprof", m.row.Mode, round+1))
			}
			if err := m.runRound(each, profile); err != nil {
				return nil, fmt.Errorf("%s %s: %w", m.row.Mode, m.row.Mix, err)
			}
		}
		fmt.Printf("round %d of %d done\n", round+1, rounds)
	}
	for _, m := range ms {
		m.row.finish()
		if m.srv != nil {
			m.row.PeakRSS = peakRSS(m.srv.Pid())
		}
		res.Rows = append(res.Rows, *m.row)
	}
	res.Ratios = ratios(res.Rows)
	printResults(res)
	return res, nil
}

// runRound runs m once for d and adds the round's rate to its row.
func (m measurement) runRound(d time.Duration, profile string) error {
	n0, wall0 := m.row.u.n, m.row.wall
	if err := m.run(d, profile); err != nil {
		return err
	}
	m.row.RoundRates = append(m.row.RoundRates, float64(m.row.u.n-n0)/(m.row.wall-wall0).Seconds())
	return nil
}

// finish computes the row's exported figures from what its rounds added.
func (r *Row) finish() {
	r.Calls = r.u.n
	if r.wall > 0 {
		r.PerSecond = float64(r.u.n) / r.wall.Seconds()
	}
	slices.Sort(r.lats)
	if len(r.lats) > 0 {
		r.P50 = micros(r.lats[len(r.lats)/2])
		r.P99 = micros(r.lats[min(len(r.lats)-1, len(r.lats)*99/100)])
	}
	if len(r.codes) > 0 {
		r.Codes = r.codes
	}
	per := func(d time.Duration) float64 {
		if r.u.n == 0 {
			return 0
		}
		return micros(d) / float64(r.u.n)
	}
	r.Server, r.Load, r.Postgres, r.Rest = per(r.u.server), per(r.u.client), per(r.u.postgres), per(r.u.rest())
	if total := r.u.idle + r.u.busy; total > 0 {
		r.Idle = float64(r.u.idle) / float64(total)
	}
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// ratios are the figures the targets of BENCHMARKS.md name, each over the
// whole run and round by round.
func ratios(rows []Row) []Ratio {
	find := func(mode, mix string) *Row {
		for i := range rows {
			if rows[i].Mode == mode && rows[i].Mix == mix {
				return &rows[i]
			}
		}
		return nil
	}
	bare, bareTx := find("bare", "new"), find("bare-tx", "new")
	var out []Ratio
	ratio := func(name, target string, numer, denom *Row, value func(*Row) float64) {
		r := Ratio{Name: name, Target: target}
		if numer == nil || denom == nil || value(denom) == 0 {
			return
		}
		r.Value = value(numer) / value(denom)
		// Round by round only for calls/s, which each round measures
		// apart; the CPU figures are sums over the run.
		r.Min, r.Max = r.Value, r.Value
		if strings.HasSuffix(name, "calls/s") {
			for i := range min(len(numer.RoundRates), len(denom.RoundRates)) {
				v := numer.RoundRates[i] / denom.RoundRates[i]
				if i == 0 {
					r.Min, r.Max = v, v
				}
				r.Min, r.Max = min(r.Min, v), max(r.Max, v)
			}
		}
		if target != "" {
			limit, _ := strconv.ParseFloat(strings.TrimSpace(target[2:]), 64)
			met := r.Value <= limit
			if strings.HasPrefix(target, ">=") {
				met = r.Value >= limit
			}
			r.Met = &met
		}
		out = append(out, r)
	}
	rate := func(r *Row) float64 { return r.PerSecond }
	server := func(r *Row) float64 { return r.Server }
	postgres := func(r *Row) float64 { return r.Postgres }
	for _, mode := range []string{"atomic", "two-phase"} {
		target := func(t string) string {
			if mode == "atomic" {
				return t
			}
			return ""
		}
		ratio(mode+" new keys / bare-tx: calls/s", target(">= 0.60"), find(mode, "new"), bareTx, rate)
		ratio(mode+" new keys / bare: calls/s", "", find(mode, "new"), bare, rate)
		ratio(mode+" new keys / bare: server CPU per call", "<= 1.25", find(mode, "new"), bare, server)
		ratio(mode+" new keys / pgbench: PostgreSQL CPU per call", "<= 1.10", find(mode, "new"), find(mode, "pgbench"), postgres)
		ratio(mode+" new keys / bare: PostgreSQL CPU per call", "", find(mode, "new"), bare, postgres)
		ratio(mode+" pgbench / bare: calls/s", "", find(mode, "pgbench"), bare, rate)
	}
	return out
}

func printResults(res *Results) {
	fmt.Println()
	fmt.Println("| mode | run | calls/s | vs bare | p50 | p99 | status codes | CPU per call: server | load tool | PostgreSQL | rest | idle | server peak RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	bare := res.Rows[0].PerSecond
	names := map[string]string{
		"new": "new key every call", "pgbench": "pgbench: the SQL of a new key", "replay": "replay of one key",
		"retry": "replay of one key, as a retry", "storm": "storm: 62 keys",
	}
	var notes []string
	for _, r := range res.Rows {
		lat := func(us float64) string {
			if us == 0 {
				return ""
			}
			return (time.Duration(us) * time.Microsecond).Round(10 * time.Microsecond).String()
		}
		var codes []string
		for code, n := range r.Codes {
			codes = append(codes, fmt.Sprintf("%s %d", code, n))
		}
		sort.Strings(codes)
		server := fmt.Sprintf("%.0f µs", r.Server)
		if r.Mix == "pgbench" {
			server = ""
		}
		fmt.Printf("| %s | %s | %.0f | %.2f | %s | %s | %s | %s | %.0f µs | %.0f µs | %.0f µs | %.0f%% | %s |\n",
			r.Mode, names[r.Mix], r.PerSecond, r.PerSecond/bare, lat(r.P50), lat(r.P99), strings.Join(codes, ", "),
			server, r.Load, r.Postgres, r.Rest, 100*r.Idle, r.PeakRSS)
		for msg, n := range r.Errors {
			notes = append(notes, fmt.Sprintf("%s, %s: %d × %s", r.Mode, names[r.Mix], n, msg))
		}
	}
	fmt.Println()
	fmt.Println("| ratio | this run | rounds | target | |")
	fmt.Println("|---|---|---|---|---|")
	for _, r := range res.Ratios {
		verdict := ""
		if r.Met != nil {
			verdict = map[bool]string{true: "met", false: "missed"}[*r.Met]
		}
		rounds := ""
		if r.Min != r.Max {
			rounds = fmt.Sprintf("%.2f–%.2f", r.Min, r.Max)
		}
		fmt.Printf("| %s | %.2f | %s | %s | %s |\n", r.Name, r.Value, rounds, r.Target, verdict)
	}
	for _, note := range notes {
		fmt.Println("-", note)
	}
}

func writeJSON(path string, res *Results) error {
	out, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(out, '\n'), 0o644)
}

// buildGhz builds ghz, pinned in tools/ghz, into dir, so that it runs
// without the go command around it, whose own CPU would count as ghz's.
func buildGhz(dir string) (string, error) {
	bin := filepath.Join(dir, "ghz")
	cmd := exec.Command("go", "build", "-modfile=tools/ghz/go.mod", "-o", bin, "github.com/bojand/ghz/cmd/ghz")
	cmd.Env = append(os.Environ(), "GOWORK=off") // tools/ghz is outside the workspace; -modfile needs it off
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building ghz: %v\n%s", err, out)
	}
	return bin, nil
}

// usage is the CPU time spent while a load ran, over all CPUs: by the
// server, by the load tool (ghz or pgbench), by PostgreSQL, and by the
// machine in all.
type usage struct {
	n                        int64 // calls or transactions
	server, client, postgres time.Duration
	busy, idle               time.Duration
}

func (u usage) rest() time.Duration { return u.busy - u.server - u.client - u.postgres }

func (u *usage) add(v usage) {
	u.n += v.n
	u.server += v.server
	u.client += v.client
	u.postgres += v.postgres
	u.busy += v.busy
	u.idle += v.idle
}

// measure runs load, which returns its count of calls and its own CPU
// time, and returns what it used. serverPid is 0 for pgbench.
func measure(serverPid, postmaster int, load func() (n int64, client time.Duration, err error)) (usage, error) {
	busy0, idle0 := machineCPU()
	server0, pg0 := processCPU(serverPid), clusterCPU(postmaster)
	n, client, err := load()
	busy1, idle1 := machineCPU()
	return usage{
		n: n, client: client,
		server:   processCPU(serverPid) - server0,
		postgres: clusterCPU(postmaster) - pg0,
		busy:     busy1 - busy0, idle: idle1 - idle0,
	}, err
}

// clockTick is the unit of /proc's CPU times: USER_HZ, 100 on Linux.
const clockTick = 10 * time.Millisecond

// statFields are the fields of /proc/PID/stat after the command's closing
// parenthesis: the state is [0], the parent's pid [1], utime [11], stime
// [12], and the reaped children's cutime [13] and cstime [14].
func statFields(pid int) []string {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
	if len(f) < 15 {
		return nil
	}
	return f
}

func ticks(fields ...string) time.Duration {
	var sum int64
	for _, f := range fields {
		n, _ := strconv.ParseInt(f, 10, 64)
		sum += n
	}
	return time.Duration(sum) * clockTick
}

// processCPU is the user and system time a process has spent, from /proc.
func processCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	f := statFields(pid)
	if f == nil {
		return 0
	}
	return ticks(f[11], f[12])
}

// clusterCPU is the CPU time a PostgreSQL cluster has spent: its
// postmaster's, its children's (backends, the WAL writer, the checkpointer,
// autovacuum), and that of the children that have exited, which the
// postmaster has reaped. A backend that was alive before a measurement and
// exits during it counts whole; such backends are the short ones of tests.
func clusterCPU(postmaster int) time.Duration {
	if postmaster == 0 {
		return 0
	}
	f := statFields(postmaster)
	if f == nil {
		return 0
	}
	total := ticks(f[11], f[12], f[13], f[14])
	entries, _ := os.ReadDir("/proc")
	parent := strconv.Itoa(postmaster)
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if f := statFields(pid); f != nil && f[1] == parent {
			total += ticks(f[11], f[12])
		}
	}
	return total
}

// findPostmaster returns the pid of the test database's postmaster: the
// parent of a backend, if the backend runs on this machine.
func findPostmaster() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pgtest.URL())
	if err != nil {
		return 0, err
	}
	defer conn.Close(ctx)
	var backend int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return 0, err
	}
	f := statFields(backend)
	if f == nil {
		return 0, errors.New("its backend is not a process of this machine")
	}
	return strconv.Atoi(f[1])
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

// report is the part of ghz's JSON output that the tables use.
type report struct {
	Count       int64          `json:"count"`
	Total       time.Duration  `json:"total"`
	StatusCodes map[string]int `json:"statusCodeDistribution"`
	Errors      map[string]int `json:"errorDistribution"`
	Details     []struct {
		Latency time.Duration `json:"latency"`
	} `json:"details"`
}

// ghz runs ghz against srv for duration, every call with the key template
// key, marked as a later attempt of a retry policy if retry is set, and adds
// its calls, latencies, codes and CPU to row. If profile is set, it also
// writes the server's CPU profile of the run there.
func ghz(bin string, srv *servertest.Server, postmaster int, key string, retry bool, duration time.Duration, clients int, profile string, row *Row) error {
	md := map[string]string{"authorization": "Bearer sk_test_acme", idemkey.KeyMetadata: key}
	if retry {
		md[interceptor.AttemptsMetadata] = "1"
	}
	metadata, err := json.Marshal(md)
	if err != nil {
		return err
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
		go func() { profiled <- saveProfile(srv, profile, duration) }()
	} else {
		profiled <- nil
	}
	var r report
	u, err := measure(srv.Pid(), postmaster, func() (int64, time.Duration, error) {
		out, err := cmd.Output()
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
	if err != nil {
		return err
	}
	row.u.add(u)
	row.wall += r.Total
	for _, d := range r.Details {
		row.lats = append(row.lats, d.Latency)
	}
	for code, n := range r.StatusCodes {
		row.codes[code] += n
	}
	for msg, n := range r.Errors {
		if row.Errors == nil {
			row.Errors = map[string]int{}
		}
		row.Errors[msg] += n
	}
	return nil
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
// costs in the mode, and adds its transactions and CPU to row. Two-phase:
// the reservation and the record, each a transaction, around the charge's
// insert. Atomic, the one-write design: in one transaction, a read of the
// key that tries its advisory lock, a savepoint, the charge's insert, and
// the completed record's insert.
func pgbench(schema string, postmaster int, atomic bool, duration time.Duration, clients int, row *Row) error {
	const (
		reserve = `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at)
  VALUES (sha256(uuid_send(gen_random_uuid())), '\x0000000000000000000000000000000000000000000000000000000000000000', 'in_progress',
    nextval('idempotency_keys_token_seq'), now() + interval '1 minute', now(), now() + interval '1 day')
  ON CONFLICT DO NOTHING RETURNING key AS k, token AS tok \gset`
		charge = `INSERT INTO charges (tenant, id, customer_id, amount, currency, description, create_time)
  VALUES ('acme', md5(random()::text), 'cus_1', 100, 'EUR', '', now());`
		record = `UPDATE idempotency_keys SET state = 'completed', outcome = '\x0a0a0a' WHERE key = :k AND token = :tok;`
		probe  = `SELECT n.k AS k, c.key IS NULL AS free FROM (SELECT sha256(uuid_send(gen_random_uuid())) AS k) AS n
  LEFT JOIN idempotency_keys AS c ON c.key = n.k
  WHERE pg_try_advisory_xact_lock(('x' || encode(substr(n.k, 1, 8), 'hex'))::bit(64)::bigint) \gset`
		insertRecord = `INSERT INTO idempotency_keys (key, fingerprint, state, token, lease_end, created_at, expires_at, outcome)
  VALUES (:k, '\x0000000000000000000000000000000000000000000000000000000000000000', 'completed', 0, now(), now(), now() + interval '1 day', '\x0a0a0a');`
	)
	script := reserve + "\n" + charge + "\n" + record + "\n"
	if atomic {
		script = "BEGIN;\n" + probe + "\nSAVEPOINT s;\n" + charge + "\n" + insertRecord + "\nCOMMIT;\n"
	}
	f, err := os.CreateTemp("", "idemkey-load-*.sql")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(script); err != nil {
		return err
	}
	f.Close()
	cmd := exec.Command(pgtest.ServerBinary("pgbench"), "-n", "-M", "prepared", "-f", f.Name(),
		"-c", strconv.Itoa(clients), "-j", "2", "-T", strconv.Itoa(max(1, int(duration.Seconds()))), pgtest.URL())
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+schema)
	var wall time.Duration
	u, err := measure(0, postmaster, func() (int64, time.Duration, error) {
		out, err := cmd.CombinedOutput()
		if err != nil {
			return 0, 0, fmt.Errorf("pgbench: %v\n%s", err, out)
		}
		tpsMatch := regexp.MustCompile(`tps = ([0-9.]+)`).FindSubmatch(out)
		nMatch := regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`).FindSubmatch(out)
		if tpsMatch == nil || nMatch == nil {
			return 0, 0, fmt.Errorf("pgbench printed no tps:\n%s", out)
		}
		tps, _ := strconv.ParseFloat(string(tpsMatch[1]), 64)
		n, _ := strconv.ParseInt(string(nMatch[1]), 10, 64)
		if tps > 0 {
			wall = time.Duration(float64(n) / tps * float64(time.Second))
		}
		return n, cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime(), nil
	})
	if err != nil {
		return err
	}
	row.u.add(u)
	row.wall += wall
	return nil
}
