package interceptor

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// RegisterKeyService registers idemkey.v1.KeyService on s, so that a client
// can ask what became of a key it sent (GetKey) without sending its request
// again. Give it the engine and the options of the server's
// UnaryServerInterceptor, so that both cover the same methods with the same
// retention: a key is scoped to the caller's tenant and to the operation
// the request names, exactly as the calls are, so a tenant never sees
// another's keys.
//
// GetKey answers STATE_UNKNOWN (no record: never seen, released, or expired
// and gone), STATE_IN_PROGRESS (with retry_after and, when steps exist,
// steps_done), STATE_COMPLETED (the recorded status and response, opened if
// sealed, as a retry would get it; the replayed metadata, as header and
// trailer metadata of GetKey's own reply) or STATE_EXPIRED (first sent,
// by the request's idempotency-first-sent metadata, longer ago than the
// retention, and no record: a retry is refused). Its reply is not a replay
// and carries no idempotent-replayed marker. It never tells the request
// the key was sent with.
//
// GetKey's errors: InvalidArgument for an operation that the options do
// not cover (a method unknown to the protobuf registry, excluded, or free of
// side effects: its keys are never kept), a malformed key or first-sent
// time; the tenant function's error as it is; Unavailable
// (IDEMPOTENCY_STORE_UNAVAILABLE) when the store fails; Unimplemented for a
// store that is not a store.Looker.
//
// It returns an error for a mistake to catch at start-up, as
// UnaryServerInterceptor does.
func RegisterKeyService(s grpc.ServiceRegistrar, eng *engine.Engine, opts ...Option) error {
	o := newOptions(opts)
	n := naming
	n.Constructor = "RegisterKeyService"
	if err := rpckit.Check(o.Coverage, n, true, eng); err != nil {
		return err
	}
	idemkeyv1.RegisterKeyServiceServer(s, &keyService{eng: eng, opts: o, methods: rpckit.NewMethods(o.Coverage, eng, "grpc")})
	return nil
}

type keyService struct {
	idemkeyv1.UnimplementedKeyServiceServer
	eng     *engine.Engine
	opts    *options
	methods *rpckit.Methods
}

var errNotCovered = toError(&idemkeyv1.Status{Code: int32(codes.InvalidArgument),
	Message: []byte("the operation is not one that idempotency keys are kept for on this server: a method it serves and covers, \"/package.Service/Method\"")})

func (k *keyService) GetKey(ctx context.Context, req *idemkeyv1.GetKeyRequest) (*idemkeyv1.GetKeyResponse, error) {
	m := k.methods.Find(req.GetOperation())
	if m == nil || !m.Covered {
		return nil, errNotCovered
	}
	firstSent, err := firstSentOf(metadata.ValueFromIncomingContext(ctx, idemkey.FirstSentMetadata))
	if err != nil {
		return nil, err
	}
	ks, err := k.eng.Lookup(ctx, m.Op, req.GetKey(), firstSent)
	if err != nil {
		return nil, lookupError(ctx, err)
	}
	resp := &idemkeyv1.GetKeyResponse{StepsDone: ks.StepsDone}
	if !ks.Expires.IsZero() {
		resp.ExpireTime = timestamppb.New(ks.Expires)
		_ = grpc.SetTrailer(ctx, metadata.Pairs(idemkey.ExpiresMetadata, idemkey.FormatDate(ks.Expires)))
	}
	switch ks.State {
	case engine.KeyUnknown:
		resp.State = idemkeyv1.GetKeyResponse_STATE_UNKNOWN
	case engine.KeyExpired:
		resp.State = idemkeyv1.GetKeyResponse_STATE_EXPIRED
	case engine.KeyInProgress:
		resp.State, resp.RetryAfter = idemkeyv1.GetKeyResponse_STATE_IN_PROGRESS, durationpb.New(ks.RetryAfter)
	case engine.KeyCompleted:
		resp.State = idemkeyv1.GetKeyResponse_STATE_COMPLETED
		k.completed(ctx, m, ks.Outcome, resp)
	}
	return resp, nil
}

// completed sets the recorded outcome in resp, read as a replay reads it,
// and sends its replayed metadata.
func (k *keyService) completed(ctx context.Context, m *rpckit.Method, outcome []byte, resp *idemkeyv1.GetKeyResponse) {
	rec, st := m.Read(ctx, k.eng.Logger(), outcome)
	if st != nil { // a record that cannot be read: what a retry gets
		resp.Status = st
		return
	}
	if md := toMD(rpckit.Allowed(rec.Header, k.opts.Replayed)); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	if md := toMD(rpckit.Allowed(rec.Trailer, k.opts.Replayed)); len(md) > 0 {
		_ = grpc.SetTrailer(ctx, md)
	}
	if rec.Status != nil {
		resp.Status = rec.Status
		return
	}
	resp.Status = &idemkeyv1.Status{}
	a, err := anypb.New(rec.Response)
	if err != nil {
		resp.Status = rpckit.Internal("idemkey: the recorded response cannot be read")
		return
	}
	resp.Response = a
}

// firstSentOf reads the first-sent metadata: zero without one.
func firstSentOf(values []string) (time.Time, error) {
	switch len(values) {
	case 0:
		return time.Time{}, nil
	case 1:
	default:
		return time.Time{}, firstSentInvalidError("it was sent more than once")
	}
	t, err := idemkey.ParseDate(strings.Trim(values[0], " \t"))
	if err != nil {
		return time.Time{}, firstSentInvalidError("it is not an HTTP date, such as " + idemkey.FormatDate(time.Now()))
	}
	if epoch := time.Unix(0, 0); t.Before(epoch) {
		t = epoch // zero means "not sent"
	}
	return t, nil
}

// lookupError is the status of engine.Lookup's error.
func lookupError(ctx context.Context, err error) error {
	var (
		keyErr *idemkey.KeyError
		fsErr  *engine.FirstSentError
	)
	switch {
	case errors.As(err, &keyErr):
		return toError(rpckit.InvalidKey(err))
	case errors.As(err, &fsErr):
		return toError(rpckit.Refusal(ctx, engine.Answer{Verdict: engine.FirstSentInvalid, Err: err}, ""))
	case errors.Is(err, errors.ErrUnsupported):
		return status.Error(codes.Unimplemented, "idemkey: this server's idempotency store cannot look keys up")
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, store.ErrDataLost):
		return toError(rpckit.Refusal(ctx, engine.Answer{Verdict: engine.StoreUnavailable}, ""))
	}
	return err // the tenant function's, as a call gets it
}
