package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/redistest"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// The tests of CreateCharge's recorded step, the processor's charge, run the
// server binary against the processor binary (example/processor), a process
// of its own, so that its charges are counted across the server's kills and
// restarts. The processor does not honour keys: a step run twice is a
// second charge.

// chargeStep is CreateCharge's step's name (example's chargeStep).
const chargeStep = "charge-card"

var processorBuilt struct {
	sync.Once
	dir, bin string
	err      error
}

// buildProcessor builds the processor once per test binary; TestMain's
// cleanup deletes it.
func buildProcessor(t *testing.T) string {
	t.Helper()
	processorBuilt.Do(func() {
		if processorBuilt.dir, processorBuilt.err = os.MkdirTemp("", "idemkey-processor."); processorBuilt.err != nil {
			return
		}
		processorBuilt.bin = filepath.Join(processorBuilt.dir, "processor")
		out, err := exec.Command("go", "build", "-o", processorBuilt.bin, "../processor").CombinedOutput()
		if err != nil {
			processorBuilt.err = fmt.Errorf("go build ../processor: %v\n%s", err, out)
		}
	})
	if processorBuilt.err != nil {
		t.Fatal(processorBuilt.err)
	}
	return processorBuilt.bin
}

func cleanupProcessor() {
	if processorBuilt.dir != "" {
		os.RemoveAll(processorBuilt.dir)
	}
}

// processorProc is a running processor process.
type processorProc struct{ url string }

// startProcessor starts the processor on a free loopback port, with args
// added to its flags, and waits until it serves; it is killed when t ends.
func startProcessor(t *testing.T, args ...string) *processorProc {
	t.Helper()
	addrFile := filepath.Join(t.TempDir(), "processor-addr")
	cmd := exec.Command(buildProcessor(t), append([]string{"-addr", "127.0.0.1:0", "-addr-file", addrFile}, args...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	var addr []byte
	waitFor(t, 30*time.Second, "the processor serves", func() bool {
		addr, _ = os.ReadFile(addrFile)
		return len(addr) > 0
	})
	return &processorProc{url: "http://" + strings.TrimSpace(string(addr))}
}

// charges returns how many charges p has made.
func (p *processorProc) charges(t *testing.T) int {
	t.Helper()
	var c struct{ Count int }
	p.get(t, "/charges/count", &c)
	return c.Count
}

// chargeOf returns the id of the charge p made for CreateCharge's step of
// acme's key, "" if none.
func (p *processorProc) chargeOf(t *testing.T, key string) string {
	t.Helper()
	derived := idemkey.DeriveKey("acme", paymentsv1.PaymentService_CreateCharge_FullMethodName, key, chargeStep)
	var c struct{ ID string }
	p.get(t, "/charges?"+url.Values{"idempotency_key": {derived}}.Encode(), &c)
	return c.ID
}

func (p *processorProc) get(t *testing.T, path string, v any) {
	t.Helper()
	resp, err := http.Get(p.url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", path, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatal(err)
	}
}

// waitFor is waitUntil with a time of its own.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting until %s", d, what)
		}
	}
}

// stepStore is a store and mode of the server.
type stepStore struct {
	name  string
	args  func(t *testing.T) []string // the server's flags for it
	kills bool                        // it outlives the server's process
	// atomic: the charge commits with the key's record, in the database
	// the flags name (ledgerOf reads both).
	atomic bool
	// lockHeld: an atomic run holds its key by a lock and writes no row
	// until it commits, so a key it holds has no expiry to tell yet.
	lockHeld bool
}

var (
	postgresAtomic = stepStore{name: "postgres/atomic", args: func(t *testing.T) []string {
		return []string{"-database-url", pgtest.SchemaURL(pgtest.Schema(t))}
	}, kills: true, atomic: true, lockHeld: true}
	postgresTwoPhase = stepStore{name: "postgres/2-phase", args: func(t *testing.T) []string {
		return []string{"-database-url", pgtest.SchemaURL(pgtest.Schema(t)), "-atomic=false"}
	}, kills: true}
	// The charges stay in the server's memory, since only the keys and
	// steps need to outlive it here.
	redisStore = stepStore{name: "redis", args: func(t *testing.T) []string {
		return []string{"-database-url=", "-redis-url", "redis://" + redistest.Start(t).Addr}
	}, kills: true}
	// The memory store loses every key and step with its process: a kill
	// test on it would charge again by design, so it runs none.
	memoryStore = stepStore{name: "memory", args: func(*testing.T) []string { return []string{"-database-url="} }}
)

var acmeRequest = &paymentsv1.CreateChargeRequest{CustomerId: "cus_steps", Amount: 100, Currency: "EUR"}

// completeCharge retries acme's CreateCharge with key on s, as a client
// would, while it is answered Aborted (a killed run's lease) or
// Unavailable, until it is answered otherwise, for at most a minute.
func completeCharge(t *testing.T, s *servertest.Server, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		charge, _, err := create(s, key, req)
		if c := status.Code(err); (c != codes.Aborted && c != codes.Unavailable) || time.Now().After(deadline) {
			return charge, err
		}
	}
}

// A server killed between the processor's answer and the charge's write
// (SIGKILL while -handler-delay holds the call there) has recorded the
// step's result: the retry on a restarted server, on the same store, gets
// the processor's id of the charge and writes the charge, and the
// processor has charged once. The two-phase runs hold a lease of 2s, which
// the killed run's retry waits out.
func TestStepKilledBeforeWrite(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{postgresTwoPhase, postgresAtomic, redisStore} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			p := startProcessor(t)
			args := append(st.args(t), "-processor-url", p.url, "-lease", "2s")
			a := servertest.Start(t, bin, append(args, "-handler-delay", "1h")...)
			key := idemkey.NewKey()
			first := make(chan error, 1)
			go func() { _, _, err := create(a, key, acmeRequest); first <- err }()
			waitFor(t, 30*time.Second, "the processor has charged", func() bool { return p.charges(t) == 1 })
			if err := a.Kill(); err != nil {
				t.Fatal(err)
			}
			if err := <-first; status.Code(err) != codes.Unavailable {
				t.Errorf("the call to the killed server: %v, want Unavailable", err)
			}
			b := servertest.Start(t, bin, args...)
			charge, err := completeCharge(t, b, key, acmeRequest)
			if err != nil {
				t.Fatalf("retry on a restarted server: %v", err)
			}
			if want := p.chargeOf(t, key); charge.GetProcessorChargeId() != want || want == "" {
				t.Errorf("the retry's processor_charge_id is %q, want the processor's charge %q", charge.GetProcessorChargeId(), want)
			}
			if n := p.charges(t); n != 1 {
				t.Errorf("the processor made %d charges, want 1", n)
			}
			again, trailer, err := create(b, key, acmeRequest)
			if err != nil || !proto.Equal(again, charge) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Errorf("a later retry: %v, %v (replayed %v), want the charge replayed", again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
		})
	}
}

// Killed at random points of the call, a new key each time, and retried on
// the restarted server until answered: however the kill fell (before the
// call arrived, inside the processor's call, which answers 100ms after it
// charged, between its answer and the write, after the reply), the
// processor has charged each key once. In atomic mode (PostgreSQL, Spanner,
// three PostgreSQL shards) the charge commits with the key's record: read
// at once after each kill, the key's charge row and its completed record
// are both there or both missing (both there if the call was answered),
// and once the retry is answered both are there, one each, so that the
// database holds a charge per key and no more.
func TestStepKilledAtRandom(t *testing.T) {
	kills := 50
	if testing.Short() {
		kills = 10
	}
	bin := servertest.Build(t)
	for _, st := range []stepStore{postgresAtomic, postgresTwoPhase, redisStore, spannerAtomic, shardsAtomic} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			p := startProcessor(t, "-answer-delay", "100ms")
			// A short lease: a two-phase run's retry waits out the killed
			// run's, renewed while it lived.
			args := append(st.args(t), "-processor-url", p.url, "-handler-delay", "100ms", "-lease", "500ms")
			var db *ledger // where an atomic charge commits with its record
			if st.atomic {
				db = ledgerOf(t, args)
			}
			s := servertest.Start(t, bin, args...)
			// How long a call takes here, to kill it anywhere in one or
			// just after it: up to a quarter of it later, so that some
			// kills fall around the commit and after the reply.
			start := time.Now()
			if _, err := completeCharge(t, s, idemkey.NewKey(), acmeRequest); err != nil {
				t.Fatal(err)
			}
			span := time.Since(start)
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 47))
			var charged, answered, committed int // kills after the processor's charge, after the reply, and after the commit
			for i := range kills {
				key := idemkey.NewKey()
				first := make(chan error, 1)
				go func() { _, _, err := create(s, key, acmeRequest); first <- err }()
				time.Sleep(time.Duration(rng.Int64N(int64(span + span/4))))
				if err := s.Kill(); err != nil {
					t.Fatal(err)
				}
				if db != nil && db.database != "" {
					// Spanner ends a dead client's transactions; the emulator
					// needs telling.
					spannertest.EndTransactions(t, db.database)
				}
				replied := <-first == nil
				if replied {
					answered++
				} else if p.chargeOf(t, key) != "" {
					charged++
				}
				if db != nil {
					c, r := db.keyState(t, key, p.chargeOf(t, key))
					if c != r || c > 1 || (replied && c != 1) {
						t.Fatalf("kill %d: right after it, %d charges of the key and %d completed records (answered %v); want both 1 or both 0, 1 if answered", i, c, r, replied)
					}
					committed += c
				}
				s = servertest.Start(t, bin, args...)
				charge, err := completeCharge(t, s, key, acmeRequest)
				if err != nil {
					t.Fatalf("kill %d: the retry: %v\n%s", i, err, s.Logs())
				}
				if want := p.chargeOf(t, key); charge.GetProcessorChargeId() != want {
					t.Fatalf("kill %d: the retry's processor_charge_id is %q, want the processor's %q", i, charge.GetProcessorChargeId(), want)
				}
				if db != nil {
					if c, r := db.keyState(t, key, charge.GetProcessorChargeId()); c != 1 || r != 1 {
						t.Fatalf("kill %d: once the retry is answered, %d charges of the key and %d completed records; want 1 and 1", i, c, r)
					}
				}
			}
			if n := p.charges(t); n != kills+1 {
				t.Errorf("the processor made %d charges for %d keys", n, kills+1)
			}
			if db != nil {
				if n := db.charges(t); n != kills+1 {
					t.Errorf("the database holds %d charges for %d keys", n, kills+1)
				}
			}
			t.Logf("%d kills within %v of a call: %d after its reply, %d after the processor's charge and before the reply; %d after the commit", kills, span, answered, charged, committed)
		})
	}
}

// A processor that charges and never answers: the server's call to it
// times out (-processor-timeout 1s) and the key is released. With
// reconcile, the retry finds the charge at the processor and completes;
// without, the retry is answered outcome unknown over every entry point,
// and the processor has still charged once.
func TestProcessorHangs(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{memoryStore, postgresTwoPhase} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			t.Run("reconcile", func(t *testing.T) {
				p := startProcessor(t, "-hang")
				s := servertest.Start(t, bin, append(st.args(t), "-processor-url", p.url, "-processor-timeout", "1s")...)
				key := idemkey.NewKey()
				if _, _, err := create(s, key, acmeRequest); status.Code(err) != codes.Unavailable {
					t.Fatalf("the first call: %v, want Unavailable: the processor did not answer", err)
				}
				charge, _, err := create(s, key, acmeRequest)
				if err != nil {
					t.Fatalf("the retry: %v, want the charge the processor made", err)
				}
				if want := p.chargeOf(t, key); charge.GetProcessorChargeId() != want || want == "" {
					t.Errorf("the retry's processor_charge_id is %q, want the processor's %q", charge.GetProcessorChargeId(), want)
				}
				if n := p.charges(t); n != 1 {
					t.Errorf("the processor made %d charges, want 1", n)
				}
			})
			t.Run("without reconcile", func(t *testing.T) {
				p := startProcessor(t, "-hang")
				httpAddrFile := filepath.Join(t.TempDir(), "http-addr")
				s := servertest.Start(t, bin, append(st.args(t), "-processor-url", p.url, "-processor-timeout", "1s", "-reconcile=false",
					"-http-addr", "127.0.0.1:0", "-http-addr-file", httpAddrFile)...)
				var addr []byte
				waitFor(t, 30*time.Second, "the HTTP address file is written", func() bool {
					addr, _ = os.ReadFile(httpAddrFile)
					return len(addr) > 0
				})
				base := "http://" + strings.TrimSpace(string(addr))
				e := &entryPoints{grpc: paymentsv1.NewPaymentServiceClient(s.Conn),
					connect: paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, base, connect.WithProtoJSON()), http: base}
				key := idemkey.NewKey()
				if _, _, err := e.viaGRPC(t, key, acmeRequest); status.Code(err) != codes.Unavailable {
					t.Fatalf("the first call: %v, want Unavailable: the processor did not answer", err)
				}
				for range 2 {
					if _, _, err := e.viaGRPC(t, key, acmeRequest); status.Code(err) != codes.Unknown || idemkey.Reason(err) != idemkey.ReasonOutcomeUnknown {
						t.Errorf("the retry over gRPC: %v, want Unknown %s", err, idemkey.ReasonOutcomeUnknown)
					}
				}
				if _, _, err := e.viaConnect(t, key, acmeRequest); connect.CodeOf(err) != connect.CodeUnknown || idemkey.Reason(err) != idemkey.ReasonOutcomeUnknown {
					t.Errorf("the retry over Connect: %v, want unknown %s", err, idemkey.ReasonOutcomeUnknown)
				}
				code, _, problem, _ := e.viaHTTP(t, key, jsonOf(t, acmeRequest))
				if code != http.StatusInternalServerError || idemhttp.ProblemReason(problem.Type) != idemkey.ReasonOutcomeUnknown {
					t.Errorf("the retry over HTTP: %d %+v, want 500 %s", code, problem, idemkey.ReasonOutcomeUnknown)
				}
				if n := p.charges(t); n != 1 {
					t.Errorf("the processor made %d charges, want 1", n)
				}
			})
		})
	}
}

// A run that holds its key longer than its lease (-lease 1s, -handler-delay
// 3s) renews it while it lives: 200 duplicates sent at once, with the
// shipped retry policy, never take the key over, so the processor and the
// ledger have one charge, and every duplicate ends with its reply.
func TestLeaseRenewed(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{memoryStore, postgresTwoPhase, redisStore} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			p := startProcessor(t)
			s := servertest.Start(t, bin, append(st.args(t), "-processor-url", p.url, "-lease", "1s", "-handler-delay", "3s")...)
			conn, err := grpc.NewClient(s.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultServiceConfig(example.ServiceConfig))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			client := paymentsv1.NewPaymentServiceClient(conn)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_" + strings.ReplaceAll(idemkey.NewKey(), "-", ""), Amount: 100, Currency: "EUR"}
			const duplicates = 200
			replies := make([]*paymentsv1.Charge, duplicates)
			var wg sync.WaitGroup
			for i := range duplicates {
				wg.Go(func() {
					ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
					c, err := client.CreateCharge(ctx, req)
					if err != nil {
						t.Errorf("duplicate %d: %v", i, err)
					}
					replies[i] = c
				})
			}
			wg.Wait()
			for i, c := range replies {
				if c != nil && !proto.Equal(c, replies[0]) {
					t.Fatalf("duplicate %d ended with %v, duplicate 0 with %v", i, c, replies[0])
				}
			}
			if n := p.charges(t); n != 1 {
				t.Errorf("the processor made %d charges, want 1", n)
			}
			ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme")
			list, err := client.ListCharges(ctx, &paymentsv1.ListChargesRequest{CustomerId: req.GetCustomerId()})
			if err != nil || len(list.GetCharges()) != 1 {
				t.Errorf("ListCharges: %d charges (%v), want 1", len(list.GetCharges()), err)
			}
		})
	}
}

// A transient failure after the processor's charge and before the write
// (-fail-after-charge 1) releases the key with the step's result kept: the
// retry completes with the processor's charge, made once.
func TestStepFailAfterCharge(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{memoryStore, postgresTwoPhase, postgresAtomic} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			p := startProcessor(t)
			s := servertest.Start(t, bin, append(st.args(t), "-processor-url", p.url, "-fail-after-charge", "1")...)
			key := idemkey.NewKey()
			if _, _, err := create(s, key, acmeRequest); status.Code(err) != codes.Unavailable {
				t.Fatalf("the first call: %v, want Unavailable", err)
			}
			charge, _, err := create(s, key, acmeRequest)
			if err != nil {
				t.Fatalf("the retry: %v", err)
			}
			if want := p.chargeOf(t, key); charge.GetProcessorChargeId() != want || want == "" {
				t.Errorf("the retry's processor_charge_id is %q, want the processor's %q", charge.GetProcessorChargeId(), want)
			}
			if n := p.charges(t); n != 1 {
				t.Errorf("the processor made %d charges, want 1", n)
			}
		})
	}
}
