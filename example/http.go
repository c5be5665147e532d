package example

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/example/paymentsv1connect"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// NewHTTPHandler returns the payment service over HTTP, for an HTTP/1.1 and
// h2c server:
//   - through connect-go, in the Connect, gRPC and gRPC-Web protocols, behind
//     idemconnect's interceptor on eng: the engine of NewServer's gRPC
//     interceptor, so the same keys, since a procedure is named and
//     fingerprinted as its gRPC method;
//   - the plain route POST /v1/charges: CreateCharge with a JSON body of
//     CreateChargeRequest's fields, the key in the Idempotency-Key header (or
//     request_id), answered 201 with the charge as JSON, or an RFC 9457
//     problem. It is a gateway to conn, the gRPC service itself, so a key
//     shares its record with the other two entry points; it passes
//     Idempotency-First-Sent on, and the key's expiry back as
//     Idempotency-Key-Expires.
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
	mux := http.NewServeMux()
	mux.Handle(paymentsv1connect.NewPaymentServiceHandler(connectService{NewService(cfg.Ledger, cfg.HandlerDelay)},
		connect.WithInterceptors(connectAuth{}, idem)))
	mux.Handle("POST /v1/charges", chargesRoute{paymentsv1.NewPaymentServiceClient(conn)})
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

// maxChargeBody bounds the JSON body of POST /v1/charges.
const maxChargeBody = 64 << 10

// chargesRoute is POST /v1/charges, a gateway to the gRPC CreateCharge.
type chargesRoute struct {
	client paymentsv1.PaymentServiceClient
}

func (g chargesRoute) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxChargeBody))
	if tooLarge := (*http.MaxBytesError)(nil); errors.As(err, &tooLarge) {
		idemhttp.WriteProblem(w, http.StatusRequestEntityTooLarge, "", "the body is larger than 64 KiB", 0)
		return
	}
	if err != nil {
		idemhttp.WriteProblem(w, http.StatusBadRequest, "", "the body could not be read", 0)
		return
	}
	req := &paymentsv1.CreateChargeRequest{}
	if err := protojson.Unmarshal(body, req); err != nil {
		idemhttp.WriteProblem(w, http.StatusBadRequest, "", "the body is not a JSON CreateChargeRequest", 0)
		return
	}
	md := metadata.MD{"authorization": r.Header.Values("Authorization")}
	key, ok, err := idemhttp.KeyFromHeader(r.Header)
	if err != nil {
		idemhttp.WriteProblem(w, http.StatusBadRequest, idemkey.ReasonKeyInvalid, err.Error(), 0)
		return
	}
	if ok {
		md.Set(idemkey.KeyMetadata, idemkey.FormatKey(key))
	}
	if sent := r.Header.Values(idemkey.FirstSentHeader); len(sent) > 0 {
		md.Set(idemkey.FirstSentMetadata, sent...) // the interceptor checks them
	}
	var header, trailer metadata.MD
	charge, err := g.client.CreateCharge(metadata.NewOutgoingContext(r.Context(), md), req, grpc.Header(&header), grpc.Trailer(&trailer))
	if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		w.Header().Set(idemkey.ReplayedHeader, "true")
	}
	if expires, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata)); ok {
		w.Header().Set(idemkey.ExpiresHeader, idemkey.FormatDate(expires))
	}
	if err != nil {
		writeStatus(w, err)
		return
	}
	out, err := protojson.Marshal(charge)
	if err != nil {
		idemhttp.WriteProblem(w, http.StatusInternalServerError, "", "the charge could not be encoded", 0)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/v1/charges/"+charge.GetId())
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(out)
}

// writeStatus answers a gRPC error as a problem: idemkey's with the status
// the Idempotency-Key draft gives its reason, any other with the status
// that corresponds to its code.
func writeStatus(w http.ResponseWriter, err error) {
	st := status.Convert(err)
	reason := interceptor.Reason(err)
	code, ok := reasonStatus[reason]
	if !ok {
		reason, code = "", codeStatus(st.Code())
	}
	detail := st.Message()
	if reason == idemkey.ReasonKeyMissing {
		detail = "idempotency key required: set the Idempotency-Key header, or request_id, to one random key per operation"
	}
	retryAfter, _ := interceptor.RetryDelay(err)
	idemhttp.WriteProblem(w, code, reason, detail, retryAfter)
}

var reasonStatus = map[string]int{
	idemkey.ReasonKeyMissing:       http.StatusBadRequest,
	idemkey.ReasonKeyInvalid:       http.StatusBadRequest,
	idemkey.ReasonKeyReused:        http.StatusUnprocessableEntity,
	idemkey.ReasonInProgress:       http.StatusConflict,
	idemkey.ReasonStoreUnavailable: http.StatusServiceUnavailable,
	idemkey.ReasonStoreFull:        http.StatusServiceUnavailable,
	idemkey.ReasonKeyExpired:       http.StatusPreconditionFailed,
	idemkey.ReasonFirstSentInvalid: http.StatusBadRequest,
}

// codeStatus is the HTTP status of a gRPC code, as Connect maps them.
func codeStatus(c codes.Code) int {
	switch c {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
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
