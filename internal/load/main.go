// Command load drives the example payment server on PostgreSQL with ghz, a
// gRPC load tool (pinned in tools/ghz, a module of its own because it needs an
// older grpc-go than the other tools), over loopback, and runs pgbench with the minimal SQL of the
// same work on the same database as the database's own ceiling. make load
// runs it and prints its table.
//
//	go run ./internal/load [-duration 10s] [-clients 16]
//
// For each mode (atomic, two-phase) it starts one server process on a schema
// of its own and measures three mixes: every call a new key, every call a
// replay of one key, and a storm (every call one of 62 keys). ghz gives
// throughput, p50 and p99, and the status codes; pgbench gives the
// transactions per second of the SQL a new key costs, without gRPC or Go.
// It also reports the server process's peak resident memory.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
)

func main() {
	duration := flag.Duration("duration", 10*time.Second, "how long each measurement runs")
	clients := flag.Int("clients", 16, "concurrent clients of ghz and of pgbench")
	flag.Parse()
	if err := run(*duration, *clients); err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
}

func run(duration time.Duration, clients int) error {
	dir, err := os.MkdirTemp("", "idemkey-load.")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin, err := servertest.Compile(dir)
	if err != nil {
		return err
	}
	fmt.Printf("%d clients, %v per measurement; PostgreSQL at the test database URL\n\n", clients, duration)
	fmt.Println("| mode | mix | calls/s | p50 | p99 | status codes | pgbench ceiling, tx/s | calls/s / ceiling | server peak RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, atomic := range []bool{true, false} {
		if err := measureMode(bin, atomic, duration, clients); err != nil {
			return err
		}
	}
	return nil
}

func measureMode(bin string, atomic bool, duration time.Duration, clients int) error {
	schema, err := pgtest.CreateSchema()
	if err != nil {
		return err
	}
	defer pgtest.DropSchema(schema)
	// The server creates its tables at start-up, pgbench's too.
	srv, err := servertest.Launch(bin, "-database-url", pgtest.SchemaURL(schema, fmt.Sprint("pool_max_conns=", clients+4)), fmt.Sprint("-atomic=", atomic))
	if err != nil {
		return err
	}
	defer srv.Kill()
	ceiling, err := pgbench(schema, atomic, duration, clients)
	if err != nil {
		return err
	}
	mode := "two-phase"
	if atomic {
		mode = "atomic"
	}
	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	for _, mix := range []struct{ name, key string }{
		{"new key every call", "{{newUUID}}"},
		{"replay of one key", "replay-" + run},
		{"storm: 62 keys", "storm-" + run + "-{{randomString 1}}"},
	} {
		r, err := ghz(srv.Addr, mix.key, duration, clients)
		if err != nil {
			return err
		}
		ratio := ""
		if strings.HasPrefix(mix.name, "new key") {
			ratio = fmt.Sprintf("%.2f", r.RPS/ceiling)
		}
		fmt.Printf("| %s | %s | %.0f | %v | %v | %s | %.0f | %s | %s |\n", mode, mix.name, r.RPS,
			r.percentile(50), r.percentile(99), r.codes(), ceiling, ratio, peakRSS(srv.Pid()))
		for msg, n := range r.Errors {
			fmt.Fprintf(os.Stderr, "%s, %s: %d × %s\n", mode, mix.name, n, msg)
		}
	}
	return nil
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

// ghz runs ghz against addr for duration, every call with the key template
// key, and parses its JSON report.
func ghz(addr, key string, duration time.Duration, clients int) (report, error) {
	metadata := fmt.Sprintf(`{"authorization": "Bearer sk_test_acme", "idempotency-key": %q}`, key)
	cmd := exec.Command("go", "tool", "-modfile=tools/ghz/go.mod", "ghz", "--insecure",
		"--call", "example.payments.v1.PaymentService.CreateCharge",
		"-d", `{"customer_id": "cus_1", "amount": 100, "currency": "EUR"}`,
		"-m", metadata,
		"-c", strconv.Itoa(clients), "-z", duration.String(),
		"--count-errors", "-O", "json", addr)
	out, err := cmd.Output()
	if err != nil {
		return report{}, fmt.Errorf("ghz: %v\n%s", err, out)
	}
	var r report
	if err := json.Unmarshal(out, &r); err != nil {
		return report{}, fmt.Errorf("ghz's report: %v", err)
	}
	return r, nil
}

// pgbench runs, with the same number of clients, the minimal SQL a new key
// costs in the mode, and returns its transactions per second. Two-phase:
// the reservation and the record, each a transaction, around the charge's
// insert. Atomic: all three in one transaction.
func pgbench(schema string, atomic bool, duration time.Duration, clients int) (float64, error) {
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
		return 0, err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(script); err != nil {
		return 0, err
	}
	f.Close()
	cmd := exec.Command(pgtest.ServerBinary("pgbench"), "-n", "-M", "prepared", "-f", f.Name(),
		"-c", strconv.Itoa(clients), "-j", "2", "-T", strconv.Itoa(int(duration.Seconds())), pgtest.URL())
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+schema)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pgbench: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`tps = ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("pgbench printed no tps:\n%s", out)
	}
	return strconv.ParseFloat(string(m[1]), 64)
}
