package interceptor

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
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
// sealed, as a retry would get it; the replayed metadata as header and
// trailer metadata of GetKey's own reply) or STATE_EXPIRED (first sent,
// by the request's idempotency-first-sent metadata, longer ago than the
// retention, and no record: a retry is refused). Its reply is not a replay
// and carries no idempotent-replayed marker; the key's expiry is in the
// trailer idempotency-key-expires, as on every answer about a key. It
// never tells the request the key was sent with.
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
	s.RegisterService(&keyServiceDesc, &keyService{eng: eng, opts: o, methods: rpckit.NewMethods(o.Coverage, eng, "grpc")})
	return nil
}

// keyServiceDesc describes idemkey.v1.KeyService as protoc-gen-go-grpc
// would (idemkey.v1 has no generated service code: rpckit.GetKeyProcedure).
var keyServiceDesc = grpc.ServiceDesc{
	ServiceName: "idemkey.v1.KeyService",
	HandlerType: (*keyServer)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "GetKey",
		Handler: func(srv any, ctx context.Context, dec func(any) error, intercept grpc.UnaryServerInterceptor) (any, error) {
			req := new(idemkeyv1.GetKeyRequest)
			if err := dec(req); err != nil {
				return nil, err
			}
			if intercept == nil {
				return srv.(*keyService).GetKey(ctx, req)
			}
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: rpckit.GetKeyProcedure}
			return intercept(ctx, req, info, func(ctx context.Context, req any) (any, error) {
				return srv.(*keyService).GetKey(ctx, req.(*idemkeyv1.GetKeyRequest))
			})
		},
	}},
	Metadata: "idemkey/v1/keys.proto",
}

// keyServer is what the service's handler type implements.
type keyServer interface {
	GetKey(context.Context, *idemkeyv1.GetKeyRequest) (*idemkeyv1.GetKeyResponse, error)
}

type keyService struct {
	eng     *engine.Engine
	opts    *options
	methods *rpckit.Methods
}

func (k *keyService) GetKey(ctx context.Context, req *idemkeyv1.GetKeyRequest) (*idemkeyv1.GetKeyResponse, error) {
	a := k.methods.GetKey(ctx, k.eng, req, metadata.ValueFromIncomingContext(ctx, idemkey.FirstSentMetadata),
		metadata.ValueFromIncomingContext(ctx, idemkey.FirstRegionMetadata), k.opts.Replayed)
	switch {
	case a.Status != nil:
		return nil, toError(a.Status)
	case a.Err != nil:
		return nil, a.Err
	}
	if md := toMD(a.Header); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	trailer := toMD(a.Trailer)
	if !a.Expires.IsZero() {
		if trailer == nil {
			trailer = metadata.MD{}
		}
		trailer[idemkey.ExpiresMetadata] = []string{idemkey.FormatDate(a.Expires)}
	}
	if len(trailer) > 0 {
		_ = grpc.SetTrailer(ctx, trailer)
	}
	return a.Response, nil
}
