package idemconnect_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// Procedures of the example's PaymentService, named as its generated code
// names them.
const (
	createCharge = "/example.payments.v1.PaymentService/CreateCharge"
	getCharge    = "/example.payments.v1.PaymentService/GetCharge"
)

type (
	chargeRequest  = connect.Request[paymentsv1.CreateChargeRequest]
	chargeResponse = connect.Response[paymentsv1.Charge]
	chargeHandler  = func(context.Context, *chargeRequest) (*chargeResponse, error)
)

// serve serves handle as the PaymentService's CreateCharge (and an echo as
// GetCharge) with the given interceptors over HTTP/1.1 and h2c, until t ends,
// and returns its base URL.
func serve(t *testing.T, handle chargeHandler, interceptors ...connect.Interceptor) string {
	t.Helper()
	return serveGet(t, handle, func(_ context.Context, req *getRequest) (*chargeResponse, error) {
		return connect.NewResponse(&paymentsv1.Charge{Id: req.Msg.GetId()}), nil
	}, interceptors...)
}

type getRequest = connect.Request[paymentsv1.GetChargeRequest]

// serveGet is serve with get as GetCharge.
func serveGet(t *testing.T, handle chargeHandler, get func(context.Context, *getRequest) (*chargeResponse, error), interceptors ...connect.Interceptor) string {
	t.Helper()
	mux := http.NewServeMux()
	opts := connect.WithInterceptors(interceptors...)
	mux.Handle(createCharge, connect.NewUnaryHandler(createCharge, handle, opts))
	mux.Handle(getCharge, connect.NewUnaryHandler(getCharge, get, opts, connect.WithIdempotency(connect.IdempotencyNoSideEffects)))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// h2c is an HTTP client that speaks HTTP/2 without TLS, as the gRPC protocol
// needs.
func h2c(t *testing.T) *http.Client {
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func newChargeClient(t *testing.T, url string, opts ...connect.ClientOption) *connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge] {
	return connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](h2c(t), url+createCharge, opts...)
}

// bearerTenant is the tenant of "Authorization: Bearer TENANT".
func bearerTenant(ctx context.Context) (string, error) {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	if !ok {
		return "", connect.NewError(connect.CodeInternal, errors.New("no call info"))
	}
	v := info.RequestHeader().Values("Authorization")
	if len(v) != 1 || !strings.HasPrefix(v[0], "Bearer ") {
		return "", connect.NewError(connect.CodeUnauthenticated, errors.New("no tenant"))
	}
	return strings.TrimPrefix(v[0], "Bearer "), nil
}

// newEngine is engine.New that fails t on an error.
func newEngine(t *testing.T, st store.Store, opts ...engine.Option) *engine.Engine {
	t.Helper()
	eng, err := engine.New(st, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return eng
}

// newInterceptor is NewServerInterceptor that fails t on an error.
func newInterceptor(t *testing.T, eng *engine.Engine, opts ...idemconnect.Option) connect.Interceptor {
	t.Helper()
	i, err := idemconnect.NewServerInterceptor(eng, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// single is an engine on a memory store whose callers are one tenant, with
// opts.
func single(t *testing.T, opts ...engine.Option) *engine.Engine {
	t.Helper()
	return newEngine(t, memory.New(), append([]engine.Option{engine.WithSingleTenant()}, opts...)...)
}

// counter is a CreateCharge handler that counts its runs and stamps each
// charge with its run.
type counter struct{ runs atomic.Int64 }

func (c *counter) handle(_ context.Context, req *chargeRequest) (*chargeResponse, error) {
	n := c.runs.Add(1)
	if req.Msg.GetDescription() == "decline" {
		err := connect.NewError(connect.CodeFailedPrecondition, errors.New("card declined"))
		d, _ := connect.NewErrorDetail(declined)
		err.AddDetail(d)
		return nil, err
	}
	return connect.NewResponse(&paymentsv1.Charge{
		Id: "ch_" + string(rune('0'+n)), Amount: req.Msg.GetAmount(), Currency: req.Msg.GetCurrency(),
		Description: req.Msg.GetDescription(), CreateTime: timestamppb.New(timestamppb.Now().AsTime()),
	}), nil
}

func (c *counter) wantRuns(t *testing.T, want int64) {
	t.Helper()
	if got := c.runs.Load(); got != want {
		t.Fatalf("the handler ran %d times, want %d", got, want)
	}
}

// declined is the detail of a declined charge's error.
var declined = &errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"}

// call makes one CreateCharge call with key (none if "") and tenant acme.
func call(ctx context.Context, client *connect.Client[paymentsv1.CreateChargeRequest, paymentsv1.Charge], key string, msg *paymentsv1.CreateChargeRequest) (*chargeResponse, error) {
	req := connect.NewRequest(msg)
	req.Header().Set("Authorization", "Bearer acme")
	if key != "" {
		req.Header().Set(idemkey.KeyHeader, key)
	}
	return client.CallUnary(ctx, req)
}
