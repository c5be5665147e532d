package idemtest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/leakcheck"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/tbtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

// mistake is a deliberate error of a handler under test.
type mistake int

const (
	none mistake = iota
	poolWrite
	effectBeforeError
	effectThenCancelled // makes its effect, then answers the cancellation: a retry makes it again
	effectThenReleased  // makes its effect, then answers Unavailable on its first run: a retry makes it again
	effectAfterReply    // answers, then makes its effect in a goroutine once backend.afterReply is closed
)

// backend is where the handler under test keeps its effects, and the
// idemkey store beside them.
type backend struct {
	name   string
	store  store.Store
	atomic bool
	pool   *pgxpool.Pool // nil: effects in memory
	count  atomic.Int64  // in memory

	failed     atomic.Bool    // effectThenReleased failed its first run
	afterReply chan struct{}  // effectAfterReply's goroutines wait for it
	late       sync.WaitGroup // effectAfterReply's goroutines
}

func openBackend(t *testing.T, kind string) *backend {
	t.Helper()
	b := &backend{name: kind, atomic: kind == "postgres-atomic", afterReply: make(chan struct{})}
	if kind == "memory" {
		b.store = memory.New()
		return b
	}
	b.pool = pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), b.pool); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(t.Context(), `CREATE TABLE charges (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	b.store = grpctest.Must(postgres.New(b.pool))
	return b
}

var backendKinds = []string{"memory", "postgres", "postgres-atomic"}

// effect makes one charge: through the call's transaction in atomic mode
// (through the pool instead, with poolWrite), else through the pool, in a
// context no cancellation cuts short.
func (b *backend) effect(ctx context.Context, m mistake) error {
	if b.pool == nil {
		b.count.Add(1)
		return nil
	}
	var db postgres.Querier = b.pool
	if tx, ok := postgres.TxFromContext(ctx); ok && m != poolWrite {
		db = tx
	}
	_, err := db.Exec(context.WithoutCancel(ctx), `INSERT INTO charges (id) VALUES ($1)`, idemkey.NewKey())
	return err
}

// effects is Chaos.Effects: the charges made.
func (b *backend) effects(ctx context.Context) (int, error) {
	if b.pool == nil {
		return int(b.count.Load()), nil
	}
	var n int
	err := b.pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
	return n, err
}

// declined is the customer whose charge is refused, with a recorded error.
const declined = "cus_declined"

// charge is the handler under test, whatever the transport: a charge, made
// once; a declined customer's refused, before any effect unless m is
// effectBeforeError. If hold is set, it is cleared, and the handler holds
// after its effect until its caller goes away: the first run only.
func (b *backend) charge(ctx context.Context, customer string, m mistake, hold *atomic.Bool) (id string, err error) {
	if customer == declined && m != effectBeforeError {
		return "", status.Error(codes.FailedPrecondition, "card declined")
	}
	if m == effectAfterReply {
		b.late.Go(func() {
			<-b.afterReply
			b.effect(context.Background(), none)
		})
		return "ch_" + idemkey.NewKey(), nil
	}
	if err := b.effect(ctx, m); err != nil {
		return "", status.Error(codes.Unavailable, "not charged")
	}
	if m == effectThenReleased && b.failed.CompareAndSwap(false, true) {
		return "", status.Error(codes.Unavailable, "provider timed out")
	}
	if customer == declined {
		return "", status.Error(codes.FailedPrecondition, "card declined")
	}
	if hold != nil && hold.CompareAndSwap(true, false) {
		<-ctx.Done()
		if m == effectThenCancelled {
			return "", status.FromContextError(ctx.Err()).Err()
		}
	}
	return "ch_" + idemkey.NewKey(), nil
}

// service is the handler over gRPC.
type service struct {
	paymentsv1.UnimplementedPaymentServiceServer
	b       *backend
	mistake mistake
	hold    *atomic.Bool // see backend.charge
}

func (s *service) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	id, err := s.b.charge(ctx, req.GetCustomerId(), s.mistake, s.hold)
	if err != nil {
		return nil, err
	}
	return &paymentsv1.Charge{Id: id, CustomerId: req.GetCustomerId(), Amount: req.GetAmount()}, nil
}

// grpcClient serves svc behind idemkey's interceptor and returns a client
// with the key interceptor, then the kit's.
func grpcClient(t *testing.T, svc *service, kit *idemtest.Kit) paymentsv1.PaymentServiceClient {
	t.Helper()
	return grpcClientWith(t, svc, kit, false)
}

// grpcClientWith is grpcClient, with the kit's server half after idemkey's
// interceptor if half is set, and the client's dial options.
func grpcClientWith(t *testing.T, svc *service, kit *idemtest.Kit, half bool, dial ...grpc.DialOption) paymentsv1.PaymentServiceClient {
	t.Helper()
	opts := []any{}
	if svc.b.atomic {
		opts = append(opts, interceptor.WithAtomicMethods(paymentsv1.PaymentService_CreateCharge_FullMethodName))
	}
	chain := []grpc.UnaryServerInterceptor{grpctest.Interceptor(svc.b.store, opts...)}
	if half {
		chain = append(chain, kit.UnaryServerInterceptor())
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	dial = append(dial, grpc.WithChainUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()), kit.UnaryClientInterceptor()))
	conn := grpctest.Dial(t, grpctest.Serve(t, srv), dial...)
	return paymentsv1.NewPaymentServiceClient(conn)
}

// createCharge is a client that retries a call that got no answer, with
// the key it made once for the operation, or with a new key per attempt.
func createCharge(ctx context.Context, client paymentsv1.PaymentServiceClient, customer string, keyPerAttempt bool) error {
	key := idemkey.NewKey()
	var err error
	for range 3 {
		if keyPerAttempt {
			key = idemkey.NewKey()
		}
		_, err = client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 100, Currency: "EUR"}, interceptor.UseKey(key))
		if status.Code(err) != codes.Unavailable {
			return err
		}
	}
	return err
}

// allChaos is every fault the kit has for calls.
func allChaos(b *backend) idemtest.Chaos {
	return idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, LoseReply: true, Effects: b.effects}
}

// The kit passes correct handlers and a correct client under every fault,
// on every store, over gRPC: a charge and a declined charge.
func TestGRPCCorrect(t *testing.T) {
	for _, kind := range backendKinds {
		t.Run(kind, func(t *testing.T) {
			b := openBackend(t, kind)
			r := tbtest.New(t)
			client := grpcClient(t, &service{b: b}, idemtest.New(r, allChaos(b)))
			if err := createCharge(t.Context(), client, "cus_1", false); err != nil {
				t.Errorf("charge: %v", err)
			}
			if err := createCharge(t.Context(), client, declined, false); status.Code(err) != codes.FailedPrecondition {
				t.Errorf("declined charge: %v, want FailedPrecondition", err)
			}
			tbtest.WantPass(t, r)
		})
	}
}

// A client that makes a key per attempt is caught when its retry after a
// lost reply carries another key, with the fix named.
func TestKeyPerAttempt(t *testing.T) {
	b := openBackend(t, "memory")
	r := tbtest.New(t)
	client := grpcClient(t, &service{b: b}, idemtest.New(r, idemtest.Chaos{LoseReply: true, Effects: b.effects}))
	if err := createCharge(t.Context(), client, "cus_1", true); err != nil {
		t.Errorf("charge: %v", err)
	}
	tbtest.WantFailure(t, r, "a key made per attempt", "once per operation", "interceptor.UseKey", "2 effects")
}

// A handler that makes its effect and then answers a recorded error is
// caught in two-phase mode; in atomic mode the error rolls the effect back,
// and the kit passes it.
func TestEffectBeforeRecordedError(t *testing.T) {
	for _, kind := range backendKinds {
		t.Run(kind, func(t *testing.T) {
			b := openBackend(t, kind)
			r := tbtest.New(t)
			client := grpcClient(t, &service{b: b, mistake: effectBeforeError}, idemtest.New(r, idemtest.Chaos{DropReply: true, Duplicates: 2, Effects: b.effects}))
			if err := createCharge(t.Context(), client, declined, false); status.Code(err) != codes.FailedPrecondition {
				t.Errorf("declined charge: %v, want FailedPrecondition", err)
			}
			if b.atomic {
				tbtest.WantPass(t, r)
				return
			}
			tbtest.WantFailure(t, r, "answered FailedPrecondition, yet left 1 effect(s): a side effect before an error", "In two-phase mode")
		})
	}
}

// The kit cancels a first attempt in its handler, and catches a handler
// that answers the cancellation after its effect, which the retry makes
// again (in two-phase mode; atomic mode rolls the first back); a handler
// that finishes its effect passes.
func TestCancelMidHandler(t *testing.T) {
	for _, kind := range backendKinds {
		for _, m := range []mistake{none, effectThenCancelled} {
			t.Run(fmt.Sprintf("%s/mistake=%v", kind, m != none), func(t *testing.T) {
				b := openBackend(t, kind)
				r := tbtest.New(t)
				hold := new(atomic.Bool)
				hold.Store(true)
				client := grpcClient(t, &service{b: b, mistake: m, hold: hold}, idemtest.New(r, idemtest.Chaos{Cancel: true, Effects: b.effects}))
				if err := createCharge(t.Context(), client, "cus_1", false); err != nil {
					t.Errorf("charge: %v", err)
				}
				// On a busy machine a probe can reach the handler before the
				// first attempt, and be the attempt cut short there.
				if report := r.Logs() + r.Failures(); !strings.Contains(report, "cancelled mid-handler") && !strings.Contains(report, "probe, cut short") {
					t.Errorf("the kit cut no attempt short in its handler:\n%s", report)
				}
				if m == none || b.atomic {
					tbtest.WantPass(t, r)
					return
				}
				tbtest.WantFailure(t, r, "one key, 2 effects", "took effect more than once")
			})
		}
	}
}

// A retry interceptor chained outside the key interceptor makes a key per
// attempt: its retry after the lost reply is caught, and the fix named.
func TestRetryOutsideKeys(t *testing.T) {
	b := openBackend(t, "memory")
	r := tbtest.New(t)
	kit := idemtest.New(r, idemtest.Chaos{LoseReply: true, Effects: b.effects})
	retry := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		for try := 1; try < 3 && status.Code(err) == codes.Unavailable; try++ {
			err = invoker(ctx, method, req, reply, cc, opts...)
		}
		return err
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(b.store)))
	paymentsv1.RegisterPaymentServiceServer(srv, &service{b: b})
	conn := grpctest.Dial(t, grpctest.Serve(t, srv),
		grpc.WithChainUnaryInterceptor(retry, grpctest.Must(interceptor.UnaryClientInterceptor()), kit.UnaryClientInterceptor()))
	_, err := paymentsv1.NewPaymentServiceClient(conn).CreateCharge(t.Context(), &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"})
	if err != nil {
		t.Errorf("charge: %v", err)
	}
	tbtest.WantFailure(t, r, "a key made per attempt", "chain a retry interceptor inside the key interceptor")
}
