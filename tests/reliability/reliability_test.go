package reliability_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

var (
	soak   = flag.Duration("soak", 0, "inject random faults for this long per mode; 0 injects each kind of fault once")
	report = flag.String("report", "", "write the results as a Markdown table to this file")
)

func TestMain(m *testing.M) {
	leakcheck.Main(m, servertest.Cleanup)
}

const (
	servers      = 2
	workers      = 12
	handlerDelay = 30 * time.Millisecond
	// callTimeout is every call's deadline, but for the clients that give up
	// mid-handler. A run's lease is at most callTimeout plus idemkey's grace of
	// 5s, and at least the grace.
	callTimeout = time.Second
	leaseGrace  = 5 * time.Second
	// leaseFloor is the shortest lease a run can hold (its grace, for a call
	// at its deadline), less some slack for the clocks of two processes.
	leaseFloor = leaseGrace - 300*time.Millisecond
)

// harness drives example server processes on a cluster of its own with many
// clients, injects faults, and records what every client received.
type harness struct {
	t       *testing.T
	cluster *cluster
	bin     string
	atomic  bool
	history history

	mu        sync.Mutex
	servers   [servers]*servertest.Server
	clients   [servers]paymentsv1.PaymentServiceClient
	logs      []string // of servers killed
	unguarded int      // calls in an outage that idemkey did not refuse
}

func (h *harness) startServer(i int) *servertest.Server {
	return servertest.Start(h.t, h.bin,
		"-database-url", h.cluster.dsn(fmt.Sprintf("application_name=idemkey-server-%d", i), "pool_max_conns=20", "statement_timeout=300"),
		"-handler-delay", handlerDelay.String(),
		fmt.Sprint("-atomic=", h.atomic),
		"-log-level", "debug")
}

func (h *harness) server(i int) *servertest.Server {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.servers[i]
}

func (h *harness) setServer(i int, s *servertest.Server) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.servers[i], h.clients[i] = s, paymentsv1.NewPaymentServiceClient(s.Conn)
}

func (h *harness) keepLogs(logs string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.logs = append(h.logs, logs)
}

// newOp returns a new op of tenant with key, or nil if tenant already uses
// key.
func (h *harness) newOp(tenant, key string) *op {
	o := &op{id: idemkey.NewKey(), tenant: tenant, key: key}
	if !h.history.add(o) {
		return nil
	}
	return o
}

// call sends o once to server i, as o's tenant, with its key.
func (h *harness) call(o *op, i int, timeout time.Duration) reply {
	h.mu.Lock()
	client := h.clients[i]
	h.mu.Unlock()
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_"+o.tenant, idemkey.KeyMetadata, o.key)
	if n := o.attempts(); n%2 == 1 {
		// Every other later attempt is marked as gRPC's retry policy marks
		// its own, so that the servers read the record first (store.Finder).
		ctx = metadata.AppendToOutgoingContext(ctx, interceptor.AttemptsMetadata, strconv.Itoa(n))
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	charge, err := client.CreateCharge(ctx, o.request())
	return o.record(start, charge, err)
}

// work is one client until ctx ends: it starts new ops (some on a key another
// tenant uses too), retries and duplicates unfinished ones, and replays
// finished ones; some of its calls give up mid-handler.
func (h *harness) work(ctx context.Context, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 2))
	tenants := [...]string{"acme", "globex"}
	for ctx.Err() == nil {
		var o *op
		switch p := rng.IntN(100); {
		case p < 25:
			o = h.history.pick(rng.IntN, func(o *op) bool { return !o.done() })
		case p < 40:
			o = h.history.pick(rng.IntN, (*op).done)
		case p < 45: // the same key as another op, for the other tenant
			if other := h.history.pick(rng.IntN, func(*op) bool { return true }); other != nil {
				tenant := tenants[0]
				if other.tenant == tenant {
					tenant = tenants[1]
				}
				o = h.newOp(tenant, other.key)
			}
		}
		if o == nil {
			o = h.newOp(tenants[rng.IntN(2)], idemkey.NewKey())
		}
		timeout := callTimeout
		if rng.IntN(100) < 10 {
			timeout = time.Duration(5+rng.IntN(40)) * time.Millisecond
		}
		pause := time.Duration(rng.IntN(4)) * time.Millisecond
		if r := h.call(o, rng.IntN(servers), timeout); r.code == codes.Unavailable {
			pause += 20 * time.Millisecond // back off, as a client would
		}
		time.Sleep(pause)
	}
}

// recoveryTime waits until every server answers a new op with OK, and returns how
// long that took.
func (h *harness) recoveryTime() time.Duration {
	start := time.Now()
	for i := range servers {
		for time.Since(start) < time.Minute {
			if r := h.call(h.newOp("acme", idemkey.NewKey()), i, callTimeout); r.code == codes.OK {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return time.Since(start)
}

// settle retries every unfinished op until it gets a final reply, once every
// lease has ended, and replays a sample of the finished ones.
func (h *harness) settle() {
	time.Sleep(callTimeout + leaseGrace + time.Second)
	var todo []*op
	for i, o := range h.history.all() {
		if !o.done() || i%10 == 0 {
			todo = append(todo, o)
		}
	}
	var wg sync.WaitGroup
	next := make(chan *op)
	for w := range workers {
		wg.Go(func() {
			for o := range next {
				for attempt := 0; attempt < 50 && !o.done(); attempt++ {
					if r := h.call(o, (w+attempt)%servers, callTimeout); !r.final() {
						time.Sleep(50 * time.Millisecond)
					}
				}
				h.call(o, w%servers, callTimeout)
			}
		})
	}
	for _, o := range todo {
		next <- o
	}
	close(next)
	wg.Wait()
}

// TestFaults runs the example servers, in atomic and in two-phase mode,
// under many clients while it injects each kind of fault (with -soak, random
// faults for that long), then checks the history: see history.check.
func TestFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("the fault harness takes a minute")
	}
	var verdicts []*verdict
	for _, atomic := range []bool{true, false} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			verdicts = append(verdicts, runFaults(t, atomic))
		})
	}
	if *report != "" {
		if err := os.WriteFile(*report, []byte(table(verdicts)), 0o644); err != nil {
			t.Error(err)
		}
	}
	t.Log("\n" + table(verdicts))
}

func runFaults(t *testing.T, atomic bool) *verdict {
	h := &harness{t: t, cluster: startCluster(t), bin: servertest.Build(t), atomic: atomic}
	for i := range servers {
		h.setServer(i, h.startServer(i))
	}
	v := &verdict{atomic: atomic}

	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() { h.work(ctx, uint64(w)) })
	}
	time.Sleep(time.Second)
	began := time.Now()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	kinds := faultKinds
	for n, end := 0, time.Now().Add(*soak); n < len(kinds) || time.Now().Before(end); n++ {
		kind := kinds[n%len(kinds)]
		if n >= len(kinds) {
			kind = kinds[rng.IntN(len(kinds))]
		}
		f := h.inject(kind, n)
		if !f.verified {
			t.Errorf("fault %q did not happen as meant: %s", f.kind, f.detail)
		}
		v.faults = append(v.faults, f)
		time.Sleep(time.Duration(300+rng.IntN(700)) * time.Millisecond)
	}
	stop()
	wg.Wait()
	faulted := time.Since(began)
	h.settle()
	t.Logf("faults took %v, settling %v", faulted.Round(time.Millisecond), (time.Since(began) - faulted).Round(time.Millisecond))

	if err := h.history.load(context.Background(), h.cluster); err != nil {
		t.Fatal(err)
	}
	h.history.check(v)
	v.unguarded = h.unguarded
	for _, p := range v.problems {
		t.Error(p)
	}
	if v.deadlinesExceeded == 0 {
		t.Error("no client gave up mid-call, so that fault was not injected")
	}
	h.checkNothingRaw(t)
	return v
}

// checkNothingRaw looks for any op's key or id, or a tenant, in what the
// servers logged at Debug level, in the errors the clients received, and in
// the idempotency records.
func (h *harness) checkNothingRaw(t *testing.T) {
	secret := map[string]bool{"acme": true, "globex": true}
	ops := h.history.all()
	for _, o := range ops {
		secret[o.key], secret[o.id] = true, true
		for _, r := range o.replies {
			if strings.Contains(r.message, o.key) || strings.Contains(r.message, o.tenant) {
				t.Errorf("an error message quotes the key or tenant of op %s: %q", o.id, r.message)
			}
		}
	}
	logs := h.logs
	for i := range servers {
		logs = append(logs, h.server(i).Logs())
	}
	for _, l := range logs {
		for _, word := range strings.FieldsFunc(l, func(r rune) bool {
			return !(r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
		}) {
			if secret[word] {
				t.Errorf("a server logged a raw key, op or tenant: %q", word)
				return
			}
		}
	}
	for _, o := range ops[:min(len(ops), 200)] {
		var n int
		if err := h.cluster.admin.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys
			WHERE position(convert_to($1, 'UTF8') IN key || fingerprint || coalesce(outcome, '')) > 0`, o.key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			t.Errorf("an idempotency record holds the raw key of op %s", o.id)
		}
	}
}

// table renders verdicts as the Markdown table of RELIABILITY.md.
func table(vs []*verdict) string {
	var b strings.Builder
	b.WriteString("| mode | requests | ops | faults injected (verified) | duplicate executions (outside the lease window) | divergent replies (with no server killed) | cross-tenant replies | unfinished ops | records stuck in progress (abandoned, lease ended) | calls failed closed | calls cut short by the client | slowest recovery |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, v := range vs {
		mode := "two-phase"
		if v.atomic {
			mode = "atomic"
		}
		verified, slowest := 0, time.Duration(0)
		for _, f := range v.faults {
			if f.verified {
				verified++
			}
			slowest = max(slowest, f.recovery)
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %d (%d) | %d (%d) | %d (%d) | %d | %d | %d (%d) | %d | %d | %v |\n",
			mode, v.requests, v.ops, len(v.faults), verified, v.duplicates, v.outsideWindow, v.divergent, v.divergentLost, v.crossTenant,
			v.unfinished, v.stuck, v.abandoned, v.failedClosed, v.deadlinesExceeded, slowest.Round(time.Millisecond))
	}
	return b.String()
}
