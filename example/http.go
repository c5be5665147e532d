package example

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	paymentsv1gw "github.com/idemkey/idemkey/example/paymentsv1gw"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemgateway"
	"github.com/idemkey/idemkey/idemhttp"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
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
//     key's expiry (Idempotency-Key-Expires) as headers;
//   - idemkey.v1.KeyService over Connect (idemconnect.NewKeyServiceHandler),
//     and GET /v1/idempotency-keys/{key}?operation=NAME on the HTTP API
//     (keyState): what became of a key, without its request.
//
// cfg.Ledger must be the ledger of the gRPC service, which it shares.
func NewHTTPHandler(eng *engine.Engine, cfg Config, conn grpc.ClientConnInterface) (http.Handler, error) {
	if cfg.Ledger == nil {
		return nil, errors.New("example: NewHTTPHandler needs the gRPC service's ledger")
	}
	opts := []idemconnect.Option{idemconnect.WithKeyField("request_id")}
	// A procedure is named as its gRPC method, so cfg's names are both.
	if len(cfg.Covered) > 0 {
		opts = append(opts, idemconnect.WithIncludedProcedures(cfg.Covered...))
	}
	for _, procedure := range slices.Sorted(maps.Keys(cfg.Retention)) {
		opts = append(opts, idemconnect.WithProcedureRetention(cfg.Retention[procedure], procedure))
	}
	if cfg.Atomic {
		opts = append(opts, idemconnect.WithAtomicProcedures(paymentsv1connect.PaymentServiceCreateChargeProcedure))
	}
	idem, err := idemconnect.NewServerInterceptor(eng, opts...)
	if err != nil {
		return nil, err
	}
	svc, err := NewServiceFromConfig(cfg)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(paymentsv1connect.NewPaymentServiceHandler(connectService{svc},
		connect.WithInterceptors(connectAuth{}, idem)))
	// The KeyService over Connect, on the interceptor's engine and options,
	// so that GetKey covers and keeps a key as the calls do.
	path, keys, err := idemconnect.NewKeyServiceHandler(eng, opts...)
	if err != nil {
		return nil, err
	}
	mux.Handle(path, connectAuthHandler(keys))
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
	if err := mux.HandlePath(http.MethodGet, keyStatePattern, keyState(mux, conn)); err != nil {
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

// connectAuthHandler is connectAuth for a handler that takes no Connect
// interceptors (idemconnect.NewKeyServiceHandler's): a caller it does not
// know is answered Unauthenticated in the request's protocol.
func connectAuthHandler(next http.Handler) http.Handler {
	errs := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, err := tenantOfBearer(r.Header.Values("Authorization"))
		if err != nil {
			_ = errs.Write(w, r, connect.NewError(connect.CodeUnauthenticated, err))
			return
		}
		next.ServeHTTP(w, r.WithContext(ContextWithTenant(r.Context(), tenant)))
	})
}

// keyStatePattern is the HTTP API's route of a key's state.
const keyStatePattern = "/v1/idempotency-keys/{key}"

// keyStateBody is the JSON body of a key that has no recorded reply, as
// idemhttp.KeyHandler writes it.
type keyStateBody struct {
	State      string   `json:"state"`
	RetryAfter int64    `json:"retry_after"`
	StepsDone  []string `json:"steps_done"`
	Expires    string   `json:"expires,omitempty"`
}

var keyStateNames = map[idemkeyv1.GetKeyResponse_State]string{
	idemkeyv1.GetKeyResponse_STATE_UNKNOWN:     "unknown",
	idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS: "in_progress",
	idemkeyv1.GetKeyResponse_STATE_EXPIRED:     "expired",
}

// keyState answers GET /v1/idempotency-keys/{key}?operation=NAME, where NAME
// is a gRPC method, such as /example.payments.v1.PaymentService/CreateCharge
// (POST /v1/charges's keys are that method's: the gateway calls it). It
// asks the gRPC service's GetKey, as the gateway's routes call the service,
// with the Authorization and Idempotency-First-Sent headers passed on; so a
// key is scoped to the caller's tenant and kept as the calls have it.
//
// idemhttp.KeyHandler answers the same question for the routes of
// idemhttp's middleware; it cannot replay this server's records, which
// the gRPC and Connect interceptors write: every HTTP route here is the
// gateway's, into the gRPC service.
//
// A completed key is answered as a retry of the operation through the
// gateway is: a charge 201 with its Location, or the recorded error as a
// problem, with Idempotent-Replayed: true and Idempotency-Key-Expires. Any
// other state is 200 JSON, as idemhttp.KeyHandler writes it; an in-progress
// key's wait is retry_after and Retry-After, in whole seconds. GetKey's
// refusals are problems at grpc-gateway's status for their code.
func keyState(mux *runtime.ServeMux, conn grpc.ClientConnInterface) runtime.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request, params map[string]string) {
		_, marshaler := runtime.MarshalerForRequest(mux, r)
		operation := r.URL.Query().Get("operation")
		ctx, err := runtime.AnnotateContext(r.Context(), mux, r, rpckit.GetKeyProcedure, runtime.WithHTTPPathPattern(keyStatePattern))
		if err != nil {
			runtime.HTTPError(r.Context(), mux, marshaler, w, r, err)
			return
		}
		var md runtime.ServerMetadata
		resp := new(idemkeyv1.GetKeyResponse)
		err = conn.Invoke(ctx, rpckit.GetKeyProcedure, &idemkeyv1.GetKeyRequest{Operation: operation, Key: params["key"]}, resp,
			grpc.Header(&md.HeaderMD), grpc.Trailer(&md.TrailerMD))
		if err != nil {
			// GetKey's messages never quote the key.
			retryAfter, _ := idemkey.RetryDelay(err)
			st := status.Convert(err)
			idemhttp.WriteProblem(w, runtime.HTTPStatusFromCode(st.Code()), idemkey.Reason(err), st.Message(), retryAfter)
			return
		}
		if resp.GetState() != idemkeyv1.GetKeyResponse_STATE_COMPLETED {
			writeKeyState(w, resp)
			return
		}
		// The reply a retry gets: the recorded metadata, the replay marker
		// and the expiry, through the gateway's own forwarding.
		if md.TrailerMD == nil {
			md.TrailerMD = metadata.MD{}
		}
		md.TrailerMD.Set(idemkey.ReplayedMetadata, "true")
		if ctx, err = runtime.AnnotateContext(r.Context(), mux, r, operation, runtime.WithHTTPPathPattern(keyStatePattern)); err != nil {
			runtime.HTTPError(r.Context(), mux, marshaler, w, r, err)
			return
		}
		ctx = runtime.NewServerMetadataContext(ctx, md)
		if code := resp.GetStatus().GetCode(); code != 0 {
			runtime.HTTPError(ctx, mux, marshaler, w, r, recordedError(resp.GetStatus()))
			return
		}
		msg, err := resp.GetResponse().UnmarshalNew()
		if err != nil {
			runtime.HTTPError(ctx, mux, marshaler, w, r, status.Error(codes.Internal, "the recorded reply of this key cannot be read"))
			return
		}
		runtime.ForwardResponseMessage(ctx, mux, marshaler, w, r, msg, mux.GetForwardResponseOptions()...)
	}
}

// recordedError is the error of a recorded status, which has the wire
// format of google.rpc.Status.
func recordedError(st *idemkeyv1.Status) error {
	b, err := proto.Marshal(st)
	var s spb.Status
	if err == nil {
		err = proto.Unmarshal(b, &s)
	}
	if err != nil {
		return status.Error(codes.Internal, "the recorded outcome of this key cannot be read")
	}
	return status.ErrorProto(&s)
}

// writeKeyState answers a key with no recorded reply as idemhttp.KeyHandler
// does.
func writeKeyState(w http.ResponseWriter, resp *idemkeyv1.GetKeyResponse) {
	body := keyStateBody{State: keyStateNames[resp.GetState()], StepsDone: resp.GetStepsDone()}
	if body.State == "" {
		body.State = "unknown"
	}
	if body.StepsDone == nil {
		body.StepsDone = []string{}
	}
	h := w.Header()
	if t := resp.GetExpireTime(); t != nil {
		body.Expires = idemkey.FormatDate(t.AsTime())
		h.Set(idemkey.ExpiresHeader, body.Expires)
	}
	if d := resp.GetRetryAfter().AsDuration(); resp.GetState() == idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS && d > 0 {
		body.RetryAfter = int64((d + time.Second - 1) / time.Second)
		h.Set("Retry-After", strconv.FormatInt(body.RetryAfter, 10))
	}
	b, _ := json.Marshal(body) // strings and a number: never fails
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	_, _ = w.Write(b)
}
