package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m, servertest.Cleanup, cleanupProcessor)
}

// The server creates its tables on an empty database, answers over loopback,
// stops on its context, and a second run on the same database replays the
// first run's reply, in either mode.
func TestRunOnPostgres(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			testRunOnPostgres(t, pgtest.SchemaURL(pgtest.Schema(t)), atomic)
		})
	}
}

// With -addr-file, the server writes the address it took (port 0: a free
// one) once it serves, and removes the file when it stops.
func TestAddrFile(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "addr")
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, lis, config{addrFile: path, ttl: time.Hour}, slog.New(slog.DiscardHandler))
	}()
	var addr []byte
	waitUntil(t, "the address file is written", func() bool {
		addr, _ = os.ReadFile(path)
		return len(addr) > 0
	})
	if got := strings.TrimSpace(string(addr)); got != lis.Addr().String() {
		t.Errorf("address file holds %q, want %q", got, lis.Addr())
	}
	conn, err := grpc.NewClient(strings.TrimSpace(string(addr)), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health check at the file's address: %v", err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the address file outlived the server: %v", err)
	}
}

func testRunOnPostgres(t *testing.T, url string, atomic bool) {
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	call := func() (*paymentsv1.Charge, metadata.MD) {
		t.Helper()
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- run(ctx, lis, config{databaseURL: url, ttl: time.Hour, atomic: atomic}, slog.New(slog.DiscardHandler))
		}()
		defer func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		}()
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		callCtx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		charge, err := paymentsv1.NewPaymentServiceClient(conn).CreateCharge(callCtx, req, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatalf("CreateCharge: %v", err)
		}
		return charge, trailer
	}
	first, trailer := call()
	if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatal("the first call was replayed")
	}
	again, trailer := call()
	if !proto.Equal(first, again) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("after a restart: %v (replayed %v), want the first run's %v, replayed", again, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), first)
	}
}

// With -idempotency=false the same service runs with no interceptor: a
// repeated key charges twice, no reply is marked replayed, and no
// idempotency table is created.
func TestWithoutIdempotency(t *testing.T) {
	schema := pgtest.Schema(t)
	s := servertest.Start(t, servertest.Build(t), "-database-url", pgtest.SchemaURL(schema), "-idempotency=false")
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	var ids []string
	for range 2 {
		charge, trailer, err := create(s, key, req)
		if err != nil {
			t.Fatalf("CreateCharge: %v", err)
		}
		if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Error("a reply of the bare server is marked replayed")
		}
		ids = append(ids, charge.GetId())
	}
	pool := pgtest.Pool(t, schema)
	if n := count(t, pool, "charges"); n != 2 || ids[0] == ids[1] {
		t.Errorf("%d charges in the database, ids %q; want 2 distinct, one per call", n, ids)
	}
	var tables []string
	if err := pool.QueryRow(context.Background(), `SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables WHERE schemaname = $1`, schema).Scan(&tables); err != nil {
		t.Fatal(err)
	}
	if len(tables) != 1 || tables[0] != "charges" {
		t.Errorf("tables in the schema: %q, want only charges: the bare server needs no idempotency table", tables)
	}
}

// With -in-transaction too, each call of the bare server runs in a
// transaction of its own, which the charge's INSERT joins: while the handler
// waits (-handler-delay, after the processor's charge and before the
// INSERT), its session is idle in that transaction and the charge is not
// yet visible; without a delay the charge commits with the reply.
func TestWithoutIdempotencyInTransaction(t *testing.T) {
	schema := pgtest.Schema(t)
	bin := servertest.Build(t)
	url := pgtest.SchemaURL(schema, "application_name="+schema)
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	pool := pgtest.Pool(t, schema)

	quick := servertest.Start(t, bin, "-database-url", url, "-idempotency=false", "-in-transaction")
	if _, _, err := create(quick, idemkey.NewKey(), req); err != nil {
		t.Fatalf("CreateCharge: %v", err)
	}
	if n := count(t, pool, "charges"); n != 1 {
		t.Fatalf("%d charges after a call answered, want 1, committed with the reply", n)
	}

	held := servertest.Start(t, bin, "-database-url", url, "-idempotency=false", "-in-transaction", "-handler-delay", "1h")
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() {
		ctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, idemkey.NewKey())
		paymentsv1.NewPaymentServiceClient(held.Conn).CreateCharge(ctx, req) // runs for an hour, until the test kills the server
	}()
	waitUntil(t, "the held call's session idle in its transaction", func() bool {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, schema).Scan(&n)
		return err == nil && n == 1
	})
	if n := count(t, pool, "charges"); n != 1 {
		t.Errorf("%d charges while the second call's handler runs, want 1: its charge is not committed yet", n)
	}
}

// -idempotency=false serves gRPC only: with an HTTP address or a Redis store,
// which would need the store it leaves out, the server refuses to start.
func TestWithoutIdempotencyRefusesStores(t *testing.T) {
	for name, cfg := range map[string]config{
		"http":  {bare: true, httpAddr: "127.0.0.1:0", ttl: time.Hour},
		"redis": {bare: true, redisURL: "redis://127.0.0.1:1/0", ttl: time.Hour},
	} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		if err := run(context.Background(), lis, cfg, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "-idempotency=false") {
			t.Errorf("%s: run: %v, want the refusal of -idempotency=false", name, err)
		}
	}
}

// -in-transaction is for the bare server on PostgreSQL: with idempotency, or
// without a database, the server refuses to start and names the flag.
func TestInTransactionNeedsBareOnPostgres(t *testing.T) {
	for name, cfg := range map[string]config{
		"idempotency": {inTransaction: true, databaseURL: pgtest.URL(), ttl: time.Hour},
		"memory":      {inTransaction: true, bare: true, ttl: time.Hour},
	} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		if err := run(context.Background(), lis, cfg, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "-in-transaction") {
			t.Errorf("%s: run: %v, want the refusal of -in-transaction", name, err)
		}
	}
}

// Server processes on one database behave as one service: a duplicate sent to
// process B while process A runs the first call is Aborted, the retry on B
// gets A's reply, and the reply survives both processes being killed. They run
// two-phase, on one processor, which A has charged before its reply is
// recorded.
func TestProcessesOnOneDatabase(t *testing.T) {
	bin := servertest.Build(t)
	schema := pgtest.Schema(t)
	url := pgtest.SchemaURL(schema)
	p := startProcessor(t)
	a := servertest.Start(t, bin, "-database-url", url, "-handler-delay=2s", "-atomic=false", "-processor-url", p.url)
	b := servertest.Start(t, bin, "-database-url", url, "-atomic=false", "-processor-url", p.url)
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

	first := make(chan *paymentsv1.Charge, 1)
	go func() {
		charge, _, err := create(a, key, req)
		if err != nil {
			t.Errorf("first call on A: %v", err)
		}
		first <- charge
	}()
	waitUntil(t, "process A has charged the processor", func() bool { return p.charges(t) == 1 })
	// B holds the duplicate for A's outcome until shortly before the
	// duplicate's deadline, which comes before A's reply.
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key), 500*time.Millisecond)
	defer cancel()
	if _, err := paymentsv1.NewPaymentServiceClient(b.Conn).CreateCharge(ctx, req); status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
		t.Fatalf("duplicate on B during A's call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
	}
	want := <-first
	wantReplay(t, b, key, req, want, "B")

	for _, s := range []*servertest.Server{a, b} {
		if err := s.Kill(); err != nil {
			t.Fatal(err)
		}
	}
	wantReplay(t, servertest.Start(t, bin, "-database-url", url, "-atomic=false", "-processor-url", p.url), key, req, want, "a new process after both were killed")
	if n := count(t, pgtest.Pool(t, schema), "charges"); n != 1 {
		t.Errorf("%d charges in the database, want 1", n)
	}
	if n := p.charges(t); n != 1 {
		t.Errorf("%d charges at the processor, want 1", n)
	}
}

// A server process killed while its atomic CreateCharge is inside the
// transaction leaves nothing behind: the database rolls back the charge and
// the reservation, and the client's retry on a restarted process charges
// once, with no lease to wait out.
func TestAtomicProcessKilled(t *testing.T) {
	bin := servertest.Build(t)
	schema := pgtest.Schema(t)
	const app = "idemkey_test_killed"
	a := servertest.Start(t, bin, "-database-url", pgtest.SchemaURL(schema, "application_name="+app), "-handler-delay=1m")
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	first := make(chan error, 1)
	go func() { _, _, err := create(a, key, req); first <- err }()

	pool := pgtest.Pool(t, schema)
	backends := func(state string) int {
		var n int
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE $2`, app, state).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitUntil(t, "A's handler is inside its transaction", func() bool { return backends("idle in transaction") == 1 })
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := <-first; status.Code(err) != codes.Unavailable {
		t.Errorf("the call to the killed process: %v, want Unavailable", err)
	}
	waitUntil(t, "the database has ended A's sessions", func() bool { return backends("%") == 0 })
	if n := count(t, pool, "charges"); n != 0 {
		t.Fatalf("%d charges after the kill, want 0", n)
	}
	if n := count(t, pool, "idempotency_keys"); n != 0 {
		t.Fatalf("%d idempotency records after the kill, want 0", n)
	}

	b := servertest.Start(t, bin, "-database-url", pgtest.SchemaURL(schema))
	charge, trailer, err := create(b, key, req)
	if err != nil || idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("retry on a restarted process: %v (replayed %v), want a fresh run", err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
	}
	again, trailer, err := create(b, key, req)
	if err != nil || !proto.Equal(again, charge) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("second retry: %v, %v (replayed %v); want the replay", again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
	}
	if n := count(t, pool, "charges"); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
}

func count(t *testing.T, pool *pgxpool.Pool, table string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

// create calls CreateCharge on s as tenant acme with key.
// wantReplay fails t unless a retry of key's req on s replays want, marked
// replayed; who names s.
func wantReplay(t *testing.T, s *servertest.Server, key string, req *paymentsv1.CreateChargeRequest, want *paymentsv1.Charge, who string) {
	t.Helper()
	got, trailer, err := create(s, key, req)
	if err != nil || !proto.Equal(got, want) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("retry on %s: %v, %v (replayed %v); want the first charge, replayed", who, got, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
	}
}

func create(s *servertest.Server, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, metadata.MD, error) {
	return createAs(s, "sk_test_acme", key, req)
}

// createAs calls CreateCharge on s with the API key apiKey and key.
func createAs(s *servertest.Server, apiKey, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, metadata.MD, error) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+apiKey, idemkey.KeyMetadata, key)
	var trailer metadata.MD
	charge, err := paymentsv1.NewPaymentServiceClient(s.Conn).CreateCharge(ctx, req, grpc.Trailer(&trailer))
	return charge, trailer, err
}

// storeFull reports whether err is the memory store's refusal of a new key.
func storeFull(err error) bool {
	return status.Code(err) == codes.ResourceExhausted && idemkey.Reason(err) == idemkey.ReasonStoreFull
}

// A flood of new keys with large replies, at the memory store's bounds: new
// keys are refused with ResourceExhausted (IDEMPOTENCY_STORE_FULL), a key let
// in records its reply (never Internal for want of room), recorded keys still
// replay, and the server's resident memory stays within a few times the byte
// bound.
func TestMemoryStoreBounds(t *testing.T) {
	const maxBytes = 32 << 20
	s := servertest.Start(t, servertest.Build(t), "-database-url=", "-memory-max-records=100000", fmt.Sprint("-memory-max-bytes=", maxBytes))
	before := residentBytes(t, s.Pid())
	first := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 1, Currency: "EUR"}
	if _, _, err := create(s, first, req); err != nil {
		t.Fatal(err)
	}
	full := 0
	big := strings.Repeat("x", 100<<10)
	for i := range 300 {
		_, _, err := create(s, idemkey.NewKey(), &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: int64(i + 2), Currency: "EUR", Description: big})
		switch {
		case storeFull(err):
			full++
		case err != nil:
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if full == 0 {
		t.Error("no new key was refused at the bound")
	}
	if _, trailer, err := create(s, first, req); err != nil || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("replay in a full store: %v (replayed %v)", err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
	}
	grown := residentBytes(t, s.Pid()) - before
	t.Logf("resident memory grew %d MiB for a bound of %d MiB; %d of 300 new keys refused", grown>>20, maxBytes>>20, full)
	// The example's own ledger keeps every charge in memory too, 30 MiB of
	// descriptions at most; the bound leaves twice that for it and the
	// garbage collector's headroom.
	if limit := int64(2*30<<20 + 4*maxBytes); grown > limit {
		t.Errorf("resident memory grew %d MiB, more than %d MiB", grown>>20, limit>>20)
	}
}

// 150 concurrent calls with 1 MiB replies against -memory-max-bytes of 32
// MiB: each call is answered its own reply, which its retry replays, or
// refused with ResourceExhausted (IDEMPOTENCY_STORE_FULL) before it runs,
// never Internal for a reply that found no room. Once tenant acme is refused,
// tenant globex's new key still runs.
func TestMemoryStoreFloodOfLargeReplies(t *testing.T) {
	const (
		calls     = 150
		replySize = 1 << 20
		maxBytes  = 32 << 20
	)
	s := servertest.Start(t, servertest.Build(t), "-database-url=", fmt.Sprint("-memory-max-bytes=", maxBytes))
	description := strings.Repeat("x", replySize)
	charge := func(amount int) *paymentsv1.CreateChargeRequest {
		return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: int64(amount), Currency: "EUR", Description: description}
	}
	keys := make([]string, calls)
	errs := make([]error, calls)
	var wg sync.WaitGroup
	for i := range calls {
		keys[i] = idemkey.NewKey()
		wg.Go(func() {
			got, _, err := create(s, keys[i], charge(i+1))
			if err == nil && (got.GetAmount() != int64(i+1) || len(got.GetDescription()) != replySize) {
				t.Errorf("call %d answered another reply: amount %d, %d bytes", i, got.GetAmount(), len(got.GetDescription()))
			}
			errs[i] = err
		})
	}
	wg.Wait()
	ok, full := 0, 0
	for i, err := range errs {
		switch {
		case err == nil:
			ok++
			got, trailer, err := create(s, keys[i], charge(i+1))
			if err != nil || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || got.GetAmount() != int64(i+1) || len(got.GetDescription()) != replySize {
				t.Errorf("retry of call %d: %v (replayed %v); want its reply replayed", i, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
		case storeFull(err):
			full++
		default:
			t.Errorf("call %d: %v; want its reply or ResourceExhausted (%s)", i, err, idemkey.ReasonStoreFull)
		}
	}
	t.Logf("%d concurrent calls with 1 MiB replies into %d MiB: %d answered, %d refused", calls, maxBytes>>20, ok, full)
	if ok == 0 {
		t.Error("no call was answered")
	}

	// acme, refused once, does not keep globex out.
	refused := false
	for i := range maxBytes / replySize {
		_, _, err := create(s, idemkey.NewKey(), charge(calls+i+1))
		if err != nil {
			if refused = storeFull(err); !refused {
				t.Fatalf("acme's new key: %v", err)
			}
			break
		}
	}
	if !refused {
		t.Fatal("acme's new keys were never refused")
	}
	if _, _, err := createAs(s, "sk_test_globex", idemkey.NewKey(), charge(1)); err != nil {
		t.Errorf("globex's new key once acme is refused: %v", err)
	}
}

// residentBytes reads a process's resident set size from /proc.
func residentBytes(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc status")
	return 0
}
