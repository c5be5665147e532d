package interceptor_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/leakcheck"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/storetest"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m)
}

const (
	createCharge = "/example.payments.v1.PaymentService/CreateCharge"
	getCharge    = "/example.payments.v1.PaymentService/GetCharge"
)

// service is a PaymentService whose CreateCharge does what the test says and
// counts its runs. GetCharge answers a fixed charge.
type service struct {
	paymentsv1.UnimplementedPaymentServiceServer
	runs   atomic.Int32
	create func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error)
}

func newService() *service {
	s := &service{}
	s.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return chargeFor(req, int(s.runs.Load())), nil
	}
	return s
}

func chargeFor(req *paymentsv1.CreateChargeRequest, n int) *paymentsv1.Charge {
	return &paymentsv1.Charge{
		Id:         "ch_" + strings.Repeat("x", n),
		CustomerId: req.GetCustomerId(),
		Amount:     req.GetAmount(),
		Currency:   req.GetCurrency(),
	}
}

func (s *service) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	s.runs.Add(1)
	return s.create(ctx, req)
}

func (s *service) GetCharge(context.Context, *paymentsv1.GetChargeRequest) (*paymentsv1.Charge, error) {
	s.runs.Add(1)
	return &paymentsv1.Charge{Id: "ch_get"}, nil
}

// block makes CreateCharge wait, once started, until release is closed.
func (s *service) block() (started, release chan struct{}) {
	started, release = make(chan struct{}), make(chan struct{})
	s.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		close(started)
		<-release
		return chargeFor(req, 1), nil
	}
	return started, release
}

func (s *service) handler() grpc.UnaryHandler {
	return func(ctx context.Context, req any) (any, error) {
		return s.CreateCharge(ctx, req.(*paymentsv1.CreateChargeRequest))
	}
}

func request(amount int64) *paymentsv1.CreateChargeRequest {
	return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR"}
}

// tenantFromMetadata reads the tenant from the "tenant" metadata, as an
// authentication interceptor would from a verified identity.
func tenantFromMetadata(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get("tenant"); len(v) == 1 {
		return v[0], nil
	}
	return "", status.Error(codes.Unauthenticated, "no tenant")
}

// transportStream is the part of a gRPC server stream that SetHeader and
// SetTrailer reach, for calling the interceptor without a server.
type transportStream struct {
	mu              sync.Mutex
	header, trailer metadata.MD
}

func (ts *transportStream) Method() string { return createCharge }
func (ts *transportStream) SetHeader(md metadata.MD) error {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.header = metadata.Join(ts.header, md)
	return nil
}
func (ts *transportStream) SendHeader(md metadata.MD) error { return ts.SetHeader(md) }
func (ts *transportStream) SetTrailer(md metadata.MD) error {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.trailer = metadata.Join(ts.trailer, md)
	return nil
}

// direct calls an interceptor the way a gRPC server would, without one.
type direct struct {
	intercept grpc.UnaryServerInterceptor
	store     *memory.Store
	clock     *storetest.Clock
	svc       *service
}

func newDirect(t testing.TB, opts ...any) *direct {
	t.Helper()
	clock := storetest.NewClock()
	st := memory.New(memory.WithClock(clock.Now))
	return &direct{intercept: grpctest.Interceptor(st, opts...), store: st, clock: clock, svc: newService()}
}

// call runs one call of method with the given metadata pairs and returns what
// the client would see.
func (d *direct) call(ctx context.Context, method string, req any, pairs ...string) (any, *transportStream, error) {
	ts := &transportStream{}
	ctx = grpc.NewContextWithServerTransportStream(ctx, ts)
	ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(pairs...))
	var handler grpc.UnaryHandler = d.svc.handler()
	if method == getCharge {
		handler = func(ctx context.Context, req any) (any, error) {
			return d.svc.GetCharge(ctx, req.(*paymentsv1.GetChargeRequest))
		}
	}
	resp, err := d.intercept(ctx, req, &grpc.UnaryServerInfo{FullMethod: method}, handler)
	return resp, ts, err
}

func (d *direct) create(t *testing.T, key string, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, *transportStream, error) {
	t.Helper()
	resp, ts, err := d.call(context.Background(), createCharge, req, idemkey.KeyMetadata, key, "tenant", "acme")
	charge, _ := resp.(*paymentsv1.Charge)
	return charge, ts, err
}

func wantReason(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("code = %v, want %v (err: %v)", got, code, err)
	}
	if got := idemkey.Reason(err); got != reason {
		t.Fatalf("reason = %q, want %q (err: %v)", got, reason, err)
	}
}

func wantRuns(t *testing.T, svc *service, want int) {
	t.Helper()
	if got := int(svc.runs.Load()); got != want {
		t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// failingStore is a store whose every call fails, as when its database is
// unreachable.
type failingStore struct{}

var errDown = fmt.Errorf("connection refused: %w", store.ErrUnavailable)

func (failingStore) Find(context.Context, store.Key) (store.Entry, bool, error) {
	return store.Entry{}, false, errDown
}
func (failingStore) Reserve(context.Context, store.Reservation) (store.Entry, error) {
	return store.Entry{}, errDown
}
func (failingStore) Complete(context.Context, store.Key, store.Token, []byte) error { return errDown }
func (failingStore) Release(context.Context, store.Key, store.Token) error          { return errDown }
func (failingStore) Sweep(context.Context, int) (int, error)                        { return 0, errDown }

// countingStore is a store, one that implements store.Finder, that counts
// the calls of Find and of Reserve.
type countingStore struct {
	store.Store
	finds, reserves atomic.Int32
}

func (s *countingStore) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	s.finds.Add(1)
	return s.Store.(store.Finder).Find(ctx, key)
}

func (s *countingStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.reserves.Add(1)
	return s.Store.Reserve(ctx, r)
}

// retryServiceConfig retries CreateCharge on UNAVAILABLE and ABORTED, as the
// example's service config does, with short backoffs for tests.
const retryServiceConfig = `{"methodConfig": [{
	"name": [{"service": "example.payments.v1.PaymentService", "method": "CreateCharge"}],
	"retryPolicy": {
		"maxAttempts": 5,
		"initialBackoff": "0.01s",
		"maxBackoff": "0.05s",
		"backoffMultiplier": 2,
		"retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
	}
}]}`

// e2e is a real gRPC server and two clients over bufconn: client retries
// through the service config and attaches keys; plain does neither.
type e2e struct {
	svc     *service
	store   *memory.Store
	client  paymentsv1.PaymentServiceClient
	plain   paymentsv1.PaymentServiceClient
	lis     *bufconn.Listener
	keys    chan string   // the key of every attempt that reached the server
	sent    chan string   // the first-sent time of every attempt that reached the server
	aborted chan struct{} // a signal for every Aborted answer
}

func newE2E(t *testing.T, opts ...any) *e2e {
	t.Helper()
	e := &e2e{svc: newService(), store: memory.New(), keys: make(chan string, 100), sent: make(chan string, 100), aborted: make(chan struct{}, 100)}
	observe := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		for _, k := range md.Get(idemkey.KeyMetadata) {
			e.keys <- k
		}
		for _, v := range md.Get(idemkey.FirstSentMetadata) {
			e.sent <- v
		}
		resp, err := handler(ctx, req)
		if status.Code(err) == codes.Aborted {
			e.aborted <- struct{}{}
		}
		return resp, err
	}
	opts = append([]any{engine.WithTenant(tenantFromMetadata)}, opts...)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverPanic, observe, grpctest.Interceptor(e.store, opts...)))
	paymentsv1.RegisterPaymentServiceServer(srv, e.svc)
	e.lis = grpctest.Serve(t, srv)
	lis := e.lis
	e.client = paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis,
		grpc.WithDefaultServiceConfig(retryServiceConfig),
		grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))
	e.plain = paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis, grpc.WithDisableRetry()))
	t.Cleanup(srv.Stop) // runs before the connections close (Stop is idempotent)
	return e
}

// recoverPanic turns a handler panic into Internal, as a recovery interceptor
// outside idemkey would; grpc-go itself lets a panic crash the server.
func recoverPanic(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = status.Error(codes.Internal, "panic")
		}
	}()
	return handler(ctx, req)
}

func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key, "tenant", "acme")
}

// rawCodec is the proto codec that also keeps the last response bytes it
// decoded, so a test can compare replies byte for byte.
type rawCodec struct {
	encoding.CodecV2
	mu   sync.Mutex
	last []byte
}

func newRawCodec() *rawCodec { return &rawCodec{CodecV2: encoding.GetCodecV2("proto")} }

func (c *rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	c.mu.Lock()
	c.last = data.Materialize()
	c.mu.Unlock()
	return c.CodecV2.Unmarshal(data, v)
}

func (c *rawCodec) lastBytes() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

func waitFor(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}
