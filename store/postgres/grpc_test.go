package postgres_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// roundTrips counts the round trips a pool makes, a statement or a pipelined
// batch each, and the statements it prepares (once per connection and
// statement). It keeps the text of the last statement sent, on its own or in
// a batch.
type roundTrips struct {
	trips, prepares atomic.Int32
	lastSQL         atomic.Value // string
}

func (c *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.trips.Add(1)
	c.lastSQL.Store(data.SQL)
	return ctx
}
func (c *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	return ctx
}
func (c *roundTrips) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	c.lastSQL.Store(data.SQL)
}
func (c *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
func (c *roundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}
func (c *roundTrips) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (c *roundTrips) reset() (trips, prepares int32) {
	c.lastSQL.Store("")
	return c.trips.Swap(0), c.prepares.Swap(0)
}

type chargeService struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs atomic.Int32
}

func (s *chargeService) CreateCharge(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	s.runs.Add(1)
	return &paymentsv1.Charge{Id: "ch_1"}, nil
}

// retryUnavailable is a service config whose policy retries CreateCharge on
// UNAVAILABLE, as a client that lost a reply would.
const retryUnavailable = `{"methodConfig": [{
  "name": [{"service": "example.payments.v1.PaymentService", "method": "CreateCharge"}],
  "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
}]}`

// serveCharges serves chargeService behind the interceptor on st over
// bufconn until the test ends, and returns a client.
func serveCharges(t *testing.T, st store.Store) (paymentsv1.PaymentServiceClient, *chargeService) {
	t.Helper()
	svc := &chargeService{}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(st)))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	return paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv))), svc
}

func createCharge(client paymentsv1.PaymentServiceClient, key string) error {
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, key)
	_, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: 1})
	return err
}

// A first call costs the database two statements (reserve, complete), a
// replay one, over a real gRPC server with the interceptor on this store.
func TestRoundTripsPerCall(t *testing.T) {
	tracer := &roundTrips{}
	r := newReplica(t, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = tracer
		c.MaxConns = 1 // one connection, so statements are prepared once
	})
	client, svc := serveCharges(t, r.store)
	call := func(key string) {
		t.Helper()
		if err := createCharge(client, key); err != nil {
			t.Fatal(err)
		}
	}
	call("warm-up") // connects and prepares both statements
	call("warm-up")
	tracer.reset()

	call("k")
	if q, p := tracer.reset(); q != 2 || p != 0 {
		t.Errorf("first call: %d statements, %d prepares; want 2 (reserve, complete), 0", q, p)
	}
	call("k")
	if q, p := tracer.reset(); q != 1 || p != 0 {
		t.Errorf("replay: %d statements, %d prepares; want 1 (reserve), 0", q, p)
	}
	if n := svc.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times for two keys, want 2", n)
	}
}

// A retry that gRPC's retry policy sends after the first attempt's reply was
// lost replays the recorded reply with one plain SELECT, in either mode: no
// reservation, and no transaction to open and roll back.
func TestRetryReplaysWithARead(t *testing.T) {
	for _, atomicMode := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomicMode), func(t *testing.T) {
			tracer := &roundTrips{}
			r := newReplica(t, func(c *pgxpool.Config) {
				c.ConnConfig.Tracer = tracer
				c.MaxConns = 1 // one connection, so statements are prepared once
			})
			var opts []any
			if atomicMode {
				opts = append(opts, interceptor.WithAtomic())
			}
			svc := &chargeService{}
			var firstAttemptTrips atomic.Int32
			// loseFirstReply answers each call's first attempt with
			// Unavailable after it has run, as if the reply were lost.
			loseFirstReply := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
				if len(metadata.ValueFromIncomingContext(ctx, interceptor.AttemptsMetadata)) > 0 {
					return handler(ctx, req)
				}
				tracer.reset()
				if _, err := handler(ctx, req); err != nil {
					return nil, err
				}
				trips, _ := tracer.reset()
				firstAttemptTrips.Store(trips)
				return nil, status.Error(codes.Unavailable, "reply lost")
			}
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(loseFirstReply, grpctest.Interceptor(r.store, opts...)))
			paymentsv1.RegisterPaymentServiceServer(srv, svc)
			client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv),
				grpc.WithDefaultServiceConfig(retryUnavailable)))

			for _, key := range []string{"warm-up", "k"} { // the warm-up prepares the statements
				if err := createCharge(client, key); err != nil {
					t.Fatalf("call with the first reply lost: %v, want the replay", err)
				}
			}
			sql, _ := tracer.lastSQL.Load().(string)
			retryTrips, prepares := tracer.reset()
			if retryTrips != 1 || prepares != 0 || !strings.HasPrefix(sql, "SELECT fingerprint, outcome, expires_at FROM") {
				t.Errorf("the retry: %d round trips, %d prepares, the last %.40q; want 1 plain SELECT, 0 prepares", retryTrips, prepares, sql)
			}
			if n := firstAttemptTrips.Load(); n != 2 {
				t.Errorf("the first attempt: %d round trips, want 2 (reserve, record)", n)
			}
			if n := svc.runs.Load(); n != 2 {
				t.Errorf("handler ran %d times for two keys, want 2", n)
			}
		})
	}
}

// With the database unreachable, a call fails closed: Unavailable, and the
// handler does not run.
func TestUnreachableFailsClosed(t *testing.T) {
	client, svc := serveCharges(t, unreachableStore(t))
	err := createCharge(client, "k")
	if status.Code(err) != codes.Unavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
		t.Errorf("call with the database down: %v, want Unavailable %s", err, idemkey.ReasonStoreUnavailable)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times without the store", n)
	}
}

// A table dropped while the server runs fails every call closed: Unavailable,
// the handler does not run, and the Error log says the table is gone and how
// to make it again.
func TestDroppedTableFailsClosed(t *testing.T) {
	r := newReplica(t)
	if _, err := r.pool.Exec(context.Background(), `DROP TABLE idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	logger, logs := logtest.New()
	svc := &chargeService{}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(r.store, engine.WithLogger(logger))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	err := createCharge(client, "k")
	if status.Code(err) != codes.Unavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
		t.Errorf("call on a dropped table: %v, want Unavailable %s", err, idemkey.ReasonStoreUnavailable)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times without its table", n)
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "the store's table or its sequence is gone") {
		t.Errorf("logged %q, want an Error record saying the table is gone", logs.String())
	}
}

// slowAtomicService holds its call's transaction for half a second, as a
// handler that writes and then calls something slow does.
type slowAtomicService struct {
	paymentsv1.UnimplementedPaymentServiceServer
}

func (slowAtomicService) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	tx, ok := postgres.TxFromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "no transaction")
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		return nil, status.Error(codes.Unavailable, "the transaction failed")
	}
	if req.GetAmount() > 1 { // the recorded key's call returns at once
		time.Sleep(500 * time.Millisecond)
	}
	return &paymentsv1.Charge{Id: fmt.Sprint("ch_", req.GetAmount())}, nil
}

// Atomic handlers that hold every transaction they may do not starve replays
// of connections: with 80 calls of 500 ms running on pgxpool's default pool
// size for two cores (4), the replay of a recorded key answers at once, as a
// first attempt and as a retry.
func TestReplayWhileAtomicHandlersHoldThePool(t *testing.T) {
	r := newReplica(t, func(c *pgxpool.Config) { c.MaxConns = 4 })
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(r.store, interceptor.WithAtomic())))
	paymentsv1.RegisterPaymentServiceServer(srv, slowAtomicService{})
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	create := func(ctx context.Context, key string, amount int64, pairs ...string) (*paymentsv1.Charge, metadata.MD, error) {
		ctx = metadata.AppendToOutgoingContext(ctx, append([]string{idemkey.KeyMetadata, key}, pairs...)...)
		var trailer metadata.MD
		c, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: amount}, grpc.Trailer(&trailer))
		return c, trailer, err
	}
	if _, _, err := create(context.Background(), "recorded", 1); err != nil {
		t.Fatal(err)
	}

	load, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range 80 {
		wg.Go(func() { _, _, _ = create(load, fmt.Sprint("new-", i), int64(i+2)) })
	}
	defer func() { stop(); wg.Wait() }()
	for deadline := time.Now().Add(10 * time.Second); r.pool.Stat().AcquiredConns() < 3; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the handlers never held the transactions")
		}
	}
	for _, pairs := range [][]string{nil, {interceptor.AttemptsMetadata, "1"}} {
		// A second is far beyond a replay's own cost, and far below the
		// seconds the 80 calls keep the transactions busy.
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		start := time.Now()
		c, trailer, err := create(ctx, "recorded", 1, pairs...)
		cancel()
		if err != nil || c.GetId() != "ch_1" || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Fatalf("replay %v during the load: %v, %v (replayed %v); want ch_1, replayed", pairs, c, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
		}
		t.Logf("replay %v answered in %v with %d of 4 connections held", pairs, time.Since(start), r.pool.Stat().AcquiredConns())
	}
}

// heldService answers CreateCharge once gate is closed, outside any
// transaction: a two-phase handler that calls something slow. Each call
// says on entered that it is in the handler.
type heldService struct {
	paymentsv1.UnimplementedPaymentServiceServer
	entered chan struct{}
	gate    chan struct{}
}

func (s heldService) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	s.entered <- struct{}{}
	<-s.gate
	return &paymentsv1.Charge{Id: fmt.Sprint("ch_", req.GetAmount())}, nil
}

// The attack that lost records: while 20 two-phase calls run their
// handlers, every connection idle in the server's pool is terminated (as a
// restart, a failover or a pooler restart does). Every call still records
// its reply, so no retry after the lease runs the handler again.
func TestIdleConnectionsTerminatedMidCalls(t *testing.T) {
	app := "idemkey_test_idle_terminated"
	r := newReplica(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	admin := pgtest.Pool(t, schemaOf(t, r.pool))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(r.store)))
	const calls = 20
	svc := heldService{entered: make(chan struct{}, calls), gate: make(chan struct{})}
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))

	errs := make(chan error, calls)
	for i := range calls {
		go func() {
			ctx := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, fmt.Sprint("key-", i))
			_, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: int64(i)})
			errs <- err
		}()
	}
	for range calls { // every call is in its handler, its key reserved
		<-svc.entered
	}
	var terminated int
	if err := admin.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
		FROM pg_stat_activity WHERE application_name = $1 AND state = 'idle'`, app).Scan(&terminated); err != nil {
		t.Fatal(err)
	}
	close(svc.gate)
	if terminated == 0 {
		t.Fatal("no idle pooled connection to terminate")
	}
	for range calls {
		if err := <-errs; err != nil {
			t.Errorf("call: %v", err)
		}
	}
	for i := range calls {
		key := store.ScopeKey("", paymentsv1.PaymentService_CreateCharge_FullMethodName, fmt.Sprint("key-", i))
		if _, found, err := r.store.Find(context.Background(), key); err != nil || !found {
			t.Errorf("call %d: its reply was not recorded (found %v, %v), so a retry after its lease runs it again", i, found, err)
		}
	}
	t.Logf("%d idle connections terminated during the calls", terminated)
}
