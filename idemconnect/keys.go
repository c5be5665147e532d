package idemconnect

import (
	"context"
	"net/http"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// NewKeyServiceHandler returns idemkey.v1.KeyService as a Connect handler
// and the path to mount it on, as connect-go's generated constructors do,
// so that a client can ask what became of a key it sent (GetKey) without
// sending its request again. Give it the engine and options of the
// server's NewServerInterceptor: a key is scoped to the caller's tenant and
// to the procedure the request names, exactly as the calls are. GetKey
// answers as interceptor.RegisterKeyService's does, with the same codes;
// the key's expiry is the Idempotency-Key-Expires header, and a completed
// key's replayed headers and trailers are GetKey's own. Its reply is not a
// replay and carries no Idempotent-Replayed marker.
//
// It returns an error for a mistake to catch at start-up, as
// NewServerInterceptor does.
func NewKeyServiceHandler(eng *engine.Engine, opts ...Option) (string, http.Handler, error) {
	o := rpckit.NewSettings[FingerprintFunc, RedactFunc]()
	for _, opt := range opts {
		opt.applyServer(o)
	}
	n := naming
	n.Constructor = "NewKeyServiceHandler"
	if err := rpckit.Check(o.Coverage, n, true, eng); err != nil {
		return "", nil, err
	}
	procs := rpckit.NewMethods(o.Coverage, eng, "connectrpc")
	getKey := func(ctx context.Context, req *connect.Request[idemkeyv1.GetKeyRequest]) (*connect.Response[idemkeyv1.GetKeyResponse], error) {
		a := procs.GetKey(ctx, eng, req.Msg, req.Header()[idemkey.FirstSentHeader], req.Header()[idemkey.FirstRegionHeader], o.Replayed)
		switch {
		case a.Status != nil:
			return nil, toError(a.Status)
		case a.Err != nil:
			return nil, a.Err // the TenantFunc's own, unchanged
		}
		resp := connect.NewResponse(a.Response)
		addEntries(resp.Header(), a.Header)
		addEntries(resp.Trailer(), a.Trailer)
		setExpires(resp.Header(), a.Expires)
		return resp, nil
	}
	method := idemkeyv1.File_idemkey_v1_keys_proto.Services().ByName("KeyService").Methods().ByName("GetKey")
	h := connect.NewUnaryHandler(rpckit.GetKeyProcedure, getKey,
		connect.WithSchema(method), connect.WithIdempotency(connect.IdempotencyNoSideEffects))
	mux := http.NewServeMux()
	mux.Handle(rpckit.GetKeyProcedure, h)
	return "/idemkey.v1.KeyService/", mux, nil
}
