package example_test

// This file is docs/testkit.md's snippet, between the markers; the page's
// copy must match it (TestREADMESnippets).

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// readme:kit
// TestCreateChargeRetries proves the service safe to retry: each call's
// first reply is dropped, three duplicates go at once and the first attempt
// is cancelled in its call; every attempt must get one answer, and the
// call must charge once. A failure names the mistake and lists the attempts.
func TestCreateChargeRetries(t *testing.T) {
	svc := &countedPayments{}
	kit := idemtest.New(t, idemtest.Chaos{
		DropReply:  true,        // the first reply is lost: the retry with its key must get it, replayed
		Duplicates: 3,           // three more attempts at once, with the same key
		Cancel:     true,        // the first attempt is cancelled in its call, then sent again
		Effects:    svc.charges, // yours: a SELECT count(*), a fake provider's calls
	})
	// Your server, behind idemkey's interceptor and then the kit's, which
	// holds the first attempt until the kit cancels it (in atomic mode, its
	// transaction then rolls back, as a server's that dies before its commit).
	addr := startServer(t, svc, kit.UnaryServerInterceptor())
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(keys, kit.UnaryClientInterceptor())) // the kit after the keys
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := paymentsv1.NewPaymentServiceClient(conn)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer acme")
	if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 1999, Currency: "EUR"}); err != nil {
		t.Fatal(err)
	}
}

// end readme

// poolWriteEnv, set in the environment, runs TestCreateChargeRetries on
// PostgreSQL in atomic mode, with a CreateCharge that writes its charge
// through the pool rather than the call's transaction: the mistake the
// README's kit test must catch (TestREADMEKitCatchesPoolWrite).
const poolWriteEnv = "IDEMKEY_README_KIT_POOL_WRITE"

// countedPayments is the README's payments service, its charges counted.
// With pool set (poolWriteEnv), it writes each charge through the pool.
type countedPayments struct {
	payments
	n    atomic.Int64
	pool *pgxpool.Pool
}

func (p *countedPayments) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	if p.pool != nil {
		// The mistake: through the pool, not postgres.TxFromContext(ctx).
		if _, err := p.pool.Exec(ctx, `INSERT INTO charges (id) VALUES ($1)`, idemkey.NewKey()); err != nil {
			return nil, err
		}
	} else {
		p.n.Add(1)
	}
	return p.payments.CreateCharge(ctx, req)
}

func (p *countedPayments) charges(ctx context.Context) (int, error) {
	if p.pool == nil {
		return int(p.n.Load()), nil
	}
	var n int
	err := p.pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
	return n, err
}

// startServer serves svc as the README's newServer serves its payments, on
// a loopback port, until t ends, with the kit's server half after idemkey's
// interceptor. With poolWriteEnv set, it serves on PostgreSQL, in atomic
// mode, and svc writes through the pool.
func startServer(t *testing.T, svc paymentsv1.PaymentServiceServer, kitHalf grpc.UnaryServerInterceptor) string {
	t.Helper()
	var st store.Store = memory.New()
	var opts []interceptor.Option
	if os.Getenv(poolWriteEnv) != "" {
		pool := pgtest.Pool(t, pgtest.Schema(t))
		if err := postgres.Migrate(t.Context(), pool); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(t.Context(), `CREATE TABLE charges (id text PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		pg, err := postgres.New(pool)
		if err != nil {
			t.Fatal(err)
		}
		st = pg
		opts = append(opts, interceptor.WithAtomicMethods(paymentsv1.PaymentService_CreateCharge_FullMethodName))
		svc.(*countedPayments).pool = pool
	}
	eng, err := engine.New(st, engine.WithTenant(callerTenant), engine.WithKeyRequired())
	if err != nil {
		t.Fatal(err)
	}
	idem, err := interceptor.UnaryServerInterceptor(eng, opts...)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem, kitHalf))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// The README's kit test catches a CreateCharge that writes through the
// pool in atomic mode every time: it runs 30 times, in a process of its
// own (this test binary, with poolWriteEnv set), and fails all 30, naming
// postgres.TxFromContext.
func TestREADMEKitCatchesPoolWrite(t *testing.T) {
	if os.Getenv(poolWriteEnv) != "" {
		t.Skip("the run that this test makes")
	}
	const runs = 30
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestCreateChargeRetries$", "-test.count="+strconv.Itoa(runs), "-test.v")
	cmd.Env = append(os.Environ(), poolWriteEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Errorf("the README's kit test passed a handler that writes through the pool:\n%s", out)
	}
	report := string(out)
	if failed, passed := strings.Count(report, "--- FAIL: TestCreateChargeRetries"), strings.Count(report, "--- PASS: TestCreateChargeRetries"); failed != runs || passed != 0 {
		t.Errorf("the README's kit test failed %d of %d runs (%d passed); want all %d failed:\n%s", failed, runs, passed, runs, report)
	}
	for _, want := range []string{"transaction rolled back", "postgres.TxFromContext(ctx)", "not through the pool"} {
		if got := strings.Count(report, want); got < runs {
			t.Errorf("%q is in %d of the %d failures:\n%s", want, got, runs, report)
		}
	}
}
