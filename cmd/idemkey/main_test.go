package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

// An address where nothing listens, with a password that must never be
// printed.
const (
	unreachablePassword = "s3cret-pw"
	unreachableURL      = "postgres://postgres:" + unreachablePassword + "@127.0.0.1:1/test?connect_timeout=2"
)

const createCharge = "/example.payments.v1.PaymentService/CreateCharge"

// idemkeyCmd runs the command line args against url, a PostgreSQL URL or a
// Spanner database's name (projects/...), and returns its exit code and
// output.
func idemkeyCmd(t *testing.T, url string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	if len(args) > 0 {
		// The command's own flags, then the database: the order of flags is free.
		flag := "-database-url"
		if strings.HasPrefix(url, "projects/") {
			flag = "-spanner"
		}
		args = append(args, flag, url)
	}
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// mustRun runs args and fails the test unless the exit code is want.
func mustRun(t *testing.T, want int, url string, args ...string) (stdout, stderr string) {
	t.Helper()
	code, stdout, stderr := idemkeyCmd(t, url, args...)
	if code != want {
		t.Fatalf("idemkey %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, want, stdout, stderr)
	}
	return stdout, stderr
}

// jsonOf runs args with -json and decodes its one object into v.
func jsonOf(t *testing.T, want int, url string, v any, args ...string) {
	t.Helper()
	stdout, _ := mustRun(t, want, url, append(args, "-json")...)
	dec := json.NewDecoder(strings.NewReader(stdout))
	if err := dec.Decode(v); err != nil {
		t.Fatalf("idemkey %s -json: %v\n%s", strings.Join(args, " "), err, stdout)
	}
	if dec.More() {
		t.Fatalf("idemkey %s -json printed more than one object:\n%s", strings.Join(args, " "), stdout)
	}
}

// newStore returns a schema of its own with the store's table, its URL, and
// a store on it.
func newStore(t *testing.T) (url, schema string, st *postgres.Store) {
	t.Helper()
	schema = pgtest.Schema(t)
	url = pgtest.SchemaURL(schema)
	mustRun(t, exitOK, url, "migrate", "up")
	st, err := postgres.New(pgtest.Pool(t, schema))
	if err != nil {
		t.Fatal(err)
	}
	return url, schema, st
}

// reserve puts an in-progress record of key in st.
func reserve(t *testing.T, st store.Store, key store.Key, lease time.Duration) store.Token {
	t.Helper()
	res, err := st.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: store.Fingerprint{1, 2, 3}, Lease: lease, Retention: time.Hour})
	if err != nil || res.State != store.Acquired {
		t.Fatalf("reserve: %v, %v", res.State, err)
	}
	return res.Token
}

// inspected is inspect -json's output.
type inspected struct {
	Hash        string
	Scope       string
	State       string
	LeaseLive   bool `json:"lease_live"`
	Expired     bool
	Fingerprint string
	Outcome     *struct {
		Kind, Code, Message string
		Bytes               int
		Details             []string
		Header, Trailer     []string
	}
}

func TestInspectMissingRecord(t *testing.T) {
	url, _, _ := newStore(t)
	_, stderr := mustRun(t, exitNotFound, url, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "no-such-key")
	if !strings.Contains(stderr, "no such record") {
		t.Errorf("stderr %q does not say there is no such record", stderr)
	}
	var out struct{ Error string }
	jsonOf(t, exitNotFound, url, &out, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "no-such-key")
	if out.Error != "not_found" {
		t.Errorf("-json error %q, want not_found", out.Error)
	}
	mustRun(t, exitNotFound, url, "forget", "-tenant", "acme", "-method", createCharge, "-key", "no-such-key")
}

// chargeService is a PaymentService whose CreateCharge returns a new charge
// on every run of the handler, and counts its runs.
type chargeService struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs atomic.Int64
}

func (s *chargeService) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	n := s.runs.Add(1)
	return &paymentsv1.Charge{
		Id:         fmt.Sprint("ch_", n),
		CustomerId: req.GetCustomerId(),
		Amount:     req.GetAmount(),
		Currency:   req.GetCurrency(),
		CreateTime: timestamppb.Now(),
	}, nil
}

// bearerTenant is the tenant of the call's "authorization: Bearer <api key>",
// with the one API key the test knows.
func bearerTenant(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if auth := md.Get("authorization"); len(auth) == 1 && auth[0] == "Bearer sk_test_acme" {
		return "acme", nil
	}
	return "", status.Error(codes.Unauthenticated, "authorization: Bearer <api key> required")
}

// A record made by a gRPC server behind the idemkey interceptor: inspect
// shows it completed with the response's size, by scope and by the prefix
// the logs show; forget makes the next call with the key run the handler
// again.
func TestRecordOfGRPCServer(t *testing.T) {
	url, _, st := newStore(t)
	recordOfGRPCServer(t, url, st)
}

// recordOfGRPCServer is TestRecordOfGRPCServer on st, whose database url
// names.
func recordOfGRPCServer(t *testing.T, url string, st store.Store) {
	eng := grpctest.Must(engine.New(st, engine.WithTenant(bearerTenant), engine.WithKeyRequired()))
	intercept := grpctest.Must(interceptor.UnaryServerInterceptor(eng))
	srv := grpc.NewServer(grpc.UnaryInterceptor(intercept))
	svc := &chargeService{}
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	runs := func(want int64) {
		t.Helper()
		if n := svc.runs.Load(); n != want {
			t.Fatalf("the handler ran %d times, want %d", n, want)
		}
	}
	const key = "order-1234-charge"
	call := func() (*paymentsv1.Charge, bool) {
		t.Helper()
		ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		charge, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 500, Currency: "EUR"}, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatalf("CreateCharge: %v", err)
		}
		return charge, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata))
	}
	first, _ := call()
	if again, replayed := call(); !replayed || again.GetId() != first.GetId() {
		t.Fatalf("the second call was not a replay of the first: %v, replayed %v", again, replayed)
	}
	runs(1)

	scope := []string{"-tenant", "acme", "-method", createCharge, "-key", key}
	stdout, _ := mustRun(t, exitOK, url, append([]string{"inspect"}, scope...)...)
	size := fmt.Sprintf("response of %d bytes", proto.Size(first))
	for _, want := range []string{"completed", size, "lease end", "expires", "fingerprint"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect does not show %q:\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout, key) {
		t.Errorf("inspect printed the raw key:\n%s", stdout)
	}
	var rec inspected
	jsonOf(t, exitOK, url, &rec, append([]string{"inspect"}, scope...)...)
	k := store.ScopeKey("acme", createCharge, key)
	if rec.Hash != hex.EncodeToString(k[:]) || rec.Scope != k.String() || rec.State != "completed" || rec.Expired || len(rec.Fingerprint) != 16 ||
		rec.Outcome == nil || rec.Outcome.Kind != "response" || rec.Outcome.Bytes != proto.Size(first) {
		t.Errorf("inspect -json: %+v, want the completed record %s with a response of %d bytes", rec, k.String(), proto.Size(first))
	}

	// The scope= of a log line finds the same record, and so does the whole hash.
	for _, hash := range []string{k.String(), hex.EncodeToString(k[:]), strings.ToUpper(k.String()[:7])} {
		var byHash inspected
		jsonOf(t, exitOK, url, &byHash, "inspect", "-hash", hash)
		if byHash.Hash != rec.Hash {
			t.Errorf("inspect -hash %s: record %s, want %s", hash, byHash.Hash, rec.Hash)
		}
	}

	stdout, _ = mustRun(t, exitOK, url, append([]string{"forget"}, scope...)...)
	if !strings.Contains(stdout, "forgot record "+rec.Hash) {
		t.Errorf("forget says:\n%s", stdout)
	}
	mustRun(t, exitNotFound, url, append([]string{"inspect"}, scope...)...)
	second, replayed := call()
	if replayed || second.GetId() == first.GetId() {
		t.Errorf("after forget: charge %s (replayed %v), want a new charge, not %s replayed", second.GetId(), replayed, first.GetId())
	}
	runs(2)
	if again, replayed := call(); !replayed || again.GetId() != second.GetId() {
		t.Errorf("the call after forget was not recorded: %v, replayed %v", again, replayed)
	}
	runs(2)
}

// forget refuses a record whose call may still be running, unless -force;
// then the call that held it can no longer record its outcome.
func TestForgetLiveInProgress(t *testing.T) {
	url, _, st := newStore(t)
	forgetLiveInProgress(t, url, st)
}

// forgetLiveInProgress is TestForgetLiveInProgress on st, whose database
// url names.
func forgetLiveInProgress(t *testing.T, url string, st store.Store) {
	k := store.ScopeKey("acme", createCharge, "running")
	token := reserve(t, st, k, time.Minute)
	scope := []string{"-tenant", "acme", "-method", createCharge, "-key", "running"}

	_, stderr := mustRun(t, exitRefused, url, append([]string{"forget"}, scope...)...)
	if !strings.Contains(stderr, "live lease") || !strings.Contains(stderr, "-force") {
		t.Errorf("forget's refusal does not say why or how: %q", stderr)
	}
	var rec inspected
	jsonOf(t, exitOK, url, &rec, append([]string{"inspect"}, scope...)...)
	if rec.State != "in_progress" || !rec.LeaseLive || rec.Outcome != nil {
		t.Errorf("after a refused forget: %+v, want in progress under a live lease, no outcome", rec)
	}

	var forgot struct {
		Forgot, Forced bool
		Record         inspected
	}
	jsonOf(t, exitOK, url, &forgot, append([]string{"forget", "-force"}, scope...)...)
	if !forgot.Forgot || !forgot.Forced || forgot.Record.State != "in_progress" {
		t.Errorf("forget -force: %+v", forgot)
	}
	mustRun(t, exitNotFound, url, append([]string{"inspect"}, scope...)...)
	if err := st.Complete(context.Background(), k, token, []byte{}); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("Complete by the forgotten holder: %v, want ErrLeaseLost", err)
	}

	// A lease that has ended needs no -force.
	reserve(t, st, store.ScopeKey("acme", createCharge, "dead"), time.Microsecond)
	time.Sleep(time.Millisecond)
	mustRun(t, exitOK, url, "forget", "-tenant", "acme", "-method", createCharge, "-key", "dead")
}

// A recorded error shows its code, message and details' types, and the
// replayed metadata by name only. -method "" is the tenant-wide scope.
func TestInspectRecordedStatus(t *testing.T) {
	url, _, st := newStore(t)
	k := store.ScopeKey("acme", "", "tenant-wide")
	token := reserve(t, st, k, time.Minute)
	info, err := anypb.New(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "example.com"})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := proto.Marshal(&idemkeyv1.Outcome{
		Result:  &idemkeyv1.Outcome_Status{Status: &idemkeyv1.Status{Code: 9, Message: []byte("card declined"), Details: []*anypb.Any{info}}},
		Header:  []*idemkeyv1.MetadataEntry{{Key: "x-request-id", Values: [][]byte{[]byte("per-caller-secret")}}},
		Trailer: []*idemkeyv1.MetadataEntry{{Key: "x-ledger-position", Values: [][]byte{[]byte("42")}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Complete(context.Background(), k, token, raw); err != nil {
		t.Fatal(err)
	}
	scope := []string{"-tenant", "acme", "-method", "", "-key", "tenant-wide"}
	stdout, _ := mustRun(t, exitOK, url, append([]string{"inspect"}, scope...)...)
	for _, want := range []string{"FailedPrecondition", "card declined", "type.googleapis.com/google.rpc.ErrorInfo", "x-request-id", "x-ledger-position"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("inspect does not show %q:\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout, "per-caller-secret") {
		t.Errorf("inspect printed a metadata value:\n%s", stdout)
	}
	var rec inspected
	jsonOf(t, exitOK, url, &rec, append([]string{"inspect"}, scope...)...)
	if o := rec.Outcome; o == nil || o.Kind != "status" || o.Code != "FailedPrecondition" || o.Message != "card declined" ||
		len(o.Details) != 1 || len(o.Header) != 1 || o.Header[0] != "x-request-id" || len(o.Trailer) != 1 {
		t.Errorf("inspect -json outcome: %+v", o)
	}
	// The same key scoped to a method is another record.
	mustRun(t, exitNotFound, url, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "tenant-wide")
}

// A prefix that several records share names none of them: the command lists
// them and inspects or forgets nothing.
func TestAmbiguousHashPrefix(t *testing.T) {
	url, _, st := newStore(t)
	byDigit := map[byte][]store.Key{}
	var shared []store.Key
	for i := 0; shared == nil; i++ {
		k := store.ScopeKey("acme", createCharge, fmt.Sprint("key-", i))
		d := k.String()[0]
		byDigit[d] = append(byDigit[d], k)
		if len(byDigit[d]) == 2 {
			shared = byDigit[d]
		}
	}
	for _, k := range shared {
		reserve(t, st, k, time.Minute)
	}
	prefix := shared[0].String()[:1]
	mustRun(t, exitUsage, url, "inspect", "-hash", prefix)
	_, stderr := mustRun(t, exitUsage, url, "forget", "-force", "-hash", prefix)
	if !strings.Contains(stderr, "matches 2 records") || !strings.Contains(stderr, hex.EncodeToString(shared[0][:])) || !strings.Contains(stderr, hex.EncodeToString(shared[1][:])) {
		t.Errorf("forget of an ambiguous prefix says:\n%s", stderr)
	}
	var out struct {
		Error   string
		Matches []struct{ Hash string }
	}
	jsonOf(t, exitUsage, url, &out, "inspect", "-hash", prefix)
	if out.Error != "ambiguous" || len(out.Matches) != 2 {
		t.Errorf("inspect -json of an ambiguous prefix: %+v", out)
	}
	var stats struct {
		InProgress int64 `json:"in_progress"`
	}
	jsonOf(t, exitOK, url, &stats, "stats")
	if stats.InProgress != 2 {
		t.Errorf("after forget of an ambiguous prefix, %d records left, want 2", stats.InProgress)
	}
}

// statsJSON is stats -json's output.
type statsJSON struct {
	Completed  int64
	InProgress int64    `json:"in_progress"`
	Live       int64    `json:"in_progress_live"`
	Expired    int64    `json:"expired_unswept"`
	Oldest     *float64 `json:"oldest_live_in_progress_seconds"`
	Total      *int64   `json:"total_bytes"` // nil on Spanner
	Indexes    []struct {
		Name  string
		Bytes int64
	}
}

// statsShows runs stats on url and fails t unless its text shows each of want.
func statsShows(t *testing.T, url string, want ...string) {
	t.Helper()
	stdout, _ := mustRun(t, exitOK, url, "stats")
	for _, w := range want {
		if !strings.Contains(stdout, w) {
			t.Errorf("stats does not show %q:\n%s", w, stdout)
		}
	}
}

func TestStatsAndSweep(t *testing.T) {
	url, schema, st := newStore(t)
	ctx := context.Background()
	reserve(t, st, store.ScopeKey("acme", createCharge, "running"), time.Minute)
	for _, key := range []string{"done", "old"} {
		k := store.ScopeKey("acme", createCharge, key)
		if err := st.Complete(ctx, k, reserve(t, st, k, time.Minute), []byte{}); err != nil {
			t.Fatal(err)
		}
	}
	old := store.ScopeKey("acme", createCharge, "old")
	pool := pgtest.Pool(t, schema)
	if _, err := pool.Exec(ctx, `UPDATE idempotency_keys SET expires_at = now() - interval '1 hour', created_at = now() - interval '25 hours' WHERE key = $1`, old[:]); err != nil {
		t.Fatal(err)
	}

	var s statsJSON
	jsonOf(t, exitOK, url, &s, "stats")
	if s.Completed != 2 || s.Live != 1 || s.Expired != 1 || s.Oldest == nil || *s.Oldest < 0 || *s.Oldest > 60 || s.Total == nil || *s.Total <= 0 || len(s.Indexes) != 2 {
		t.Errorf("stats: %+v, want 2 completed, 1 live in progress, 1 expired, sizes", s)
	}
	statsShows(t, url, "expired, not swept", "idempotency_keys_pkey", "oldest live in progress")

	var inspectOld inspected
	jsonOf(t, exitOK, url, &inspectOld, "inspect", "-hash", old.String())
	if !inspectOld.Expired {
		t.Errorf("inspect of an expired record: %+v, want expired", inspectOld)
	}
	stdout, _ := mustRun(t, exitOK, url, "sweep", "-share", "0.05")
	if strings.TrimSpace(stdout) != "swept 1 expired records and steps" {
		t.Errorf("sweep says %q", stdout)
	}
	var swept struct{ Deleted int }
	jsonOf(t, exitOK, url, &swept, "sweep")
	if swept.Deleted != 0 {
		t.Errorf("a second sweep deleted %d", swept.Deleted)
	}
	jsonOf(t, exitOK, url, &s, "stats")
	if s.Completed != 1 || s.Expired != 0 {
		t.Errorf("stats after the sweep: %+v", s)
	}
}

// migrate status, down and up on a fresh schema, under the default table and
// under schema.name.
func TestMigrateRoundTrip(t *testing.T) {
	schema := pgtest.Schema(t)
	url := pgtest.SchemaURL(schema)
	for _, table := range []string{postgres.DefaultTable, schema + ".custom_keys"} {
		t.Run(table, func(t *testing.T) {
			type statusJSON struct {
				Changed    []string
				Migrations []struct {
					Version int
					Name    string
					Applied *time.Time `json:"applied_at"`
				}
			}
			status := func(action string, want int, args ...string) statusJSON {
				t.Helper()
				var s statusJSON
				jsonOf(t, want, url, &s, append([]string{"migrate", action, "-table", table}, args...)...)
				return s
			}
			if s := status("status", exitOK); len(s.Migrations) == 0 || s.Migrations[0].Applied != nil {
				t.Fatalf("status of a fresh schema: %+v, want pending migrations", s)
			}
			if s := status("up", exitOK); len(s.Changed) != len(s.Migrations) || s.Migrations[0].Applied == nil {
				t.Fatalf("up: %+v, want every migration applied", s)
			}
			if s := status("up", exitOK); len(s.Changed) != 0 {
				t.Fatalf("a second up applied %v", s.Changed)
			}
			stdout, _ := mustRun(t, exitOK, url, "migrate", "status", "-table", table)
			if !strings.Contains(stdout, "001_create_idempotency_keys  applied") {
				t.Errorf("status says:\n%s", stdout)
			}

			// A table with records is not dropped without -force; one step
			// down, which keeps the table, keeps them too.
			st, err := postgres.New(pgtest.Pool(t, schema), postgres.WithTable(table))
			if err != nil {
				t.Fatal(err)
			}
			reserve(t, st, store.ScopeKey("acme", createCharge, "k"), time.Minute)
			if s := status("down", exitOK); len(s.Changed) != 1 {
				t.Fatalf("one step down of a table with records: %+v, want the newest migration reverted", s)
			}
			mustRun(t, exitOK, url, "inspect", "-table", table, "-tenant", "acme", "-method", createCharge, "-key", "k")
			status("up", exitOK)
			_, stderr := mustRun(t, exitRefused, url, "migrate", "down", "-to", "0", "-table", table)
			if !strings.Contains(stderr, "holds 1 records") {
				t.Errorf("down of a table with records says %q", stderr)
			}
			mustRun(t, exitOK, url, "inspect", "-table", table, "-tenant", "acme", "-method", createCharge, "-key", "k")

			if s := status("down", exitOK, "-to", "0", "-force"); len(s.Changed) != len(s.Migrations) || s.Migrations[0].Applied != nil {
				t.Fatalf("down -to 0: %+v, want every migration reverted", s)
			}
			_, stderr = mustRun(t, exitDatabase, url, "stats", "-table", table)
			if !strings.Contains(stderr, "not found: run idemkey migrate up") {
				t.Errorf("stats after down says %q", stderr)
			}
			if s := status("down", exitOK); len(s.Changed) != 0 {
				t.Errorf("down with nothing applied reverted %v", s.Changed)
			}
			status("up", exitOK)
			if s := status("down", exitOK); len(s.Changed) != 1 { // one step, on an empty table
				t.Errorf("down reverted %v, want one migration", s.Changed)
			}
			status("up", exitOK)
			mustRun(t, exitNotFound, url, "inspect", "-table", table, "-tenant", "acme", "-method", createCharge, "-key", "k")
		})
	}
}

func TestMissingTable(t *testing.T) {
	url := pgtest.SchemaURL(pgtest.Schema(t))
	for _, args := range [][]string{
		{"inspect", "-hash", "abc"},
		{"forget", "-tenant", "acme", "-method", createCharge, "-key", "k"},
		{"stats"},
		{"sweep"},
	} {
		_, stderr := mustRun(t, exitDatabase, url, args...)
		if want := "idemkey: table idempotency_keys not found: run idemkey migrate up\n"; stderr != want {
			t.Errorf("idemkey %s: stderr %q, want %q", args[0], stderr, want)
		}
	}
	_, stderr := mustRun(t, exitDatabase, url, "stats", "-table", "nowhere.keys")
	if !strings.Contains(stderr, "table nowhere.keys not found: run idemkey migrate up -table nowhere.keys") {
		t.Errorf("stats of another table says %q", stderr)
	}
	var out struct{ Error, Message string }
	jsonOf(t, exitDatabase, url, &out, "stats")
	if out.Error != "database" || !strings.Contains(out.Message, "not found") {
		t.Errorf("stats -json: %+v", out)
	}
}

func TestUnreachableDatabase(t *testing.T) {
	for _, args := range [][]string{
		{"inspect", "-hash", "abc"},
		{"stats", "-json"},
		{"migrate", "up"},
	} {
		code, stdout, stderr := idemkeyCmd(t, unreachableURL, args...)
		if code != exitDatabase {
			t.Errorf("idemkey %s: exit %d, want %d", args[0], code, exitDatabase)
		}
		if strings.Contains(stdout+stderr, unreachablePassword) {
			t.Errorf("idemkey %s printed the password:\n%s%s", args[0], stdout, stderr)
		}
		if !strings.Contains(stdout+stderr, "cannot connect to the database at postgres://postgres:xxxxx@127.0.0.1:1/test") {
			t.Errorf("idemkey %s does not say where it could not connect:\n%s%s", args[0], stdout, stderr)
		}
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"inspect", "-hash", "abc", "-tenant", "acme"},
		{"inspect", "-tenant", "acme", "-key", "k"},                                  // no -method
		{"inspect", "-tenant", "acme", "-method", "CreateCharge", "-key", "k"},       // not a full method
		{"inspect", "-tenant", "acme", "-method", createCharge, "-key", "not valid"}, // a space
		{"inspect", "-hash", "xyz"},
		{"inspect", "-hash", strings.Repeat("a", 65)},
		{"inspect", "-hash", "abc", "-table", "Bad"},
		{"inspect", "-hash", "abc", "extra"},
		{"stats", "-database-url", ""},
		{"migrate"},
		{"migrate", "sideways"},
		{"sweep", "-no-such-flag"},
		{"sweep", "-share", "0"},
		{"sweep", "-share", "1.5"},
		{"sweep", "-share", "NaN"},
	} {
		url := unreachableURL // nothing is asked of the database
		if slices.Contains(args, "-database-url") {
			url = ""
		}
		code, stdout, stderr := idemkeyCmd(t, url, args...)
		if code != exitUsage || stderr == "" {
			t.Errorf("idemkey %q: exit %d, stderr %q, want %d and a message", args, code, stderr, exitUsage)
		}
		if strings.Contains(stdout+stderr, unreachablePassword) {
			t.Errorf("idemkey %q printed the password", args)
		}
	}
}

// hashRange turns a prefix of any length into the range of keys that start
// with it.
func TestHashRange(t *testing.T) {
	for prefix, want := range map[string][2]string{
		"ab":   {"ab", "ac"},
		"abf":  {"abf0", "ac00"},
		"a":    {"a0", "b0"},
		"ff":   {"ff", ""},
		"9fff": {"9fff", "a000"},
	} {
		r, err := hashRange(prefix)
		if err != nil || hex.EncodeToString(r.lo) != want[0] || hex.EncodeToString(r.hi) != want[1] || r.exact {
			t.Errorf("hashRange(%q) = %x..%x, %v; want %s..%s", prefix, r.lo, r.hi, err, want[0], want[1])
		}
	}
}
