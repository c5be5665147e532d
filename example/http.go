package example

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	paymentsv1gw "github.com/idemkey/idemkey/example/paymentsv1gw"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemgateway"
	"github.com/idemkey/idemkey/idemhttp"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// NewHTTPHandler returns the payment service over HTTP, for an HTTP/1.1 and
// h2c server:
//   - through connect-go, in the Connect, gRPC and gRPC-Web protocols, behind
//     idemconnect's interceptor on eng: the engine of NewServer's gRPC
//     interceptor, so the same keys, since a procedure is named and
//     fingerprinted as its gRPC method;
//   - the HTTP API under /v1/, through grpc-gateway (newGateway): POST
//     /v1/charges is CreateCharge with a JSON body of CreateChargeRequest's
//     fields, the key in the Idempotency-Key header (or request_id),
//     answered 201 with the charge as JSON, or an RFC 9457 problem; GET
//     /v1/charges/{id} and GET /v1/customers/{customer_id}/charges are
//     GetCharge and ListCharges. It is a gateway to conn, the gRPC service
//     itself, so a key shares its record with the other entry points; it
//     passes Idempotency-First-Sent on, and tells the replay marker and the
//     key's expiry (Idempotency-Key-Expires) as headers.
//
// cfg.Ledger must be the ledger of the gRPC service, which it shares.
func NewHTTPHandler(eng *engine.Engine, cfg Config, conn grpc.ClientConnInterface) (http.Handler, error) {
	if cfg.Ledger == nil {
		return nil, errors.New("example: NewHTTPHandler needs the gRPC service's ledger")
	}
	opts := []idemconnect.Option{idemconnect.WithKeyField("request_id")}
	if cfg.Atomic {
		opts = append(opts, idemconnect.WithAtomicProcedures(paymentsv1connect.PaymentServiceCreateChargeProcedure))
	}
	idem, err := idemconnect.NewServerInterceptor(eng, opts...)
	if err != nil {
		return nil, err
	}
	svc, err := newService(cfg)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(paymentsv1connect.NewPaymentServiceHandler(connectService{svc},
		connect.WithInterceptors(connectAuth{}, idem)))
	gw, err := newGateway(conn)
	if err != nil {
		return nil, err
	}
	mux.Handle("/v1/", gw)
	return mux, nil
}

// connectService is the Service behind connect-go: a gRPC status error
// becomes the *connect.Error of the same code, message and details.
type connectService struct{ svc *Service }

func (c connectService) CreateCharge(ctx context.Context, req *connect.Request[paymentsv1.CreateChargeRequest]) (*connect.Response[paymentsv1.Charge], error) {
	return reply(c.svc.CreateCharge(ctx, req.Msg))
}

func (c connectService) GetCharge(ctx context.Context, req *connect.Request[paymentsv1.GetChargeRequest]) (*connect.Response[paymentsv1.Charge], error) {
	return reply(c.svc.GetCharge(ctx, req.Msg))
}

func (c connectService) ListCharges(ctx context.Context, req *connect.Request[paymentsv1.ListChargesRequest]) (*connect.Response[paymentsv1.ListChargesResponse], error) {
	return reply(c.svc.ListCharges(ctx, req.Msg))
}

func reply[T any](msg *T, err error) (*connect.Response[T], error) {
	if err == nil {
		return connect.NewResponse(msg), nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return nil, err
	}
	ce := connect.NewError(connect.Code(st.Code()), errors.New(st.Message()))
	for _, d := range st.Proto().GetDetails() {
		if detail, err := connect.NewErrorDetail(d); err == nil {
			ce.AddDetail(detail)
		}
	}
	return nil, ce
}

// connectAuth is Authenticate for connect-go: the Authorization header
// "Bearer <api key>" names the tenant.
type connectAuth struct{}

func (connectAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		tenant, err := tenantOfBearer(req.Header().Values("Authorization"))
		if err != nil {
			return nil, connect.NewError(connect.CodeUnauthenticated, err)
		}
		return next(context.WithValue(ctx, tenantKey{}, tenant), req)
	}
}

func (connectAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (connectAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// maxGatewayBody bounds the JSON body of a request to the HTTP API.
const maxGatewayBody = 64 << 10

// newGateway is the service's HTTP API (payments_http.yaml) through
// grpc-gateway, in front of conn, the gRPC service itself, with idemkey's
// headers and statuses (idemgateway), and the service's own errors as
// problems too (writeProblem). A charge is answered 201 Created
// with its Location, as a replay of it is.
func newGateway(conn grpc.ClientConnInterface) (http.Handler, error) {
	mux := runtime.NewServeMux(append(idemgateway.ServeMuxOptions(idemgateway.WithErrorHandler(writeProblem)),
		runtime.WithForwardResponseOption(created))...)
	if err := paymentsv1gw.RegisterPaymentServiceHandlerClient(context.Background(), mux, paymentsv1.NewPaymentServiceClient(conn)); err != nil {
		return nil, err
	}
	return http.MaxBytesHandler(mux, maxGatewayBody), nil
}

// created answers a charge that CreateCharge made 201, at its Location.
func created(ctx context.Context, w http.ResponseWriter, m proto.Message) error {
	charge, ok := m.(*paymentsv1.Charge)
	if method, _ := runtime.RPCMethod(ctx); !ok || method != paymentsv1.PaymentService_CreateCharge_FullMethodName {
		return nil
	}
	w.Header().Set("Location", "/v1/charges/"+charge.GetId())
	w.WriteHeader(http.StatusCreated)
	return nil
}

// writeProblem answers an error of the service itself as an RFC 9457
// problem, as idemgateway answers idemkey's refusals, at grpc-gateway's
// status for its code. An error the gateway made before any call (it has
// no reply metadata), such as a body that is not the method's JSON, gets a
// detail of its own: grpc-gateway's quotes the request.
func writeProblem(ctx context.Context, _ *runtime.ServeMux, _ runtime.Marshaler, w http.ResponseWriter, _ *http.Request, err error) {
	st := status.Convert(err)
	detail := st.Message()
	if md, _ := runtime.ServerMetadataFromContext(ctx); st.Code() == codes.InvalidArgument && md.HeaderMD == nil && md.TrailerMD == nil {
		detail = "the request is not the method's JSON message"
	}
	idemhttp.WriteProblem(w, runtime.HTTPStatusFromCode(st.Code()), "", detail, 0)
}

// tenantOfBearer is the tenant of the one Authorization value
// "Bearer <api key>".
func tenantOfBearer(auth []string) (string, error) {
	if len(auth) != 1 {
		return "", errors.New("authorization: Bearer <api key> required")
	}
	token, ok := strings.CutPrefix(auth[0], "Bearer ")
	tenant, known := apiKeys[token]
	if !ok || !known {
		return "", errors.New("unknown API key")
	}
	return tenant, nil
}
