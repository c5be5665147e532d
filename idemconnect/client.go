package idemconnect

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey"
)

// NewClientInterceptor returns an interceptor for Connect clients that
// attaches an idempotency key to every call of a covered procedure: the one
// already in the request's Idempotency-Key header, else the one of
// ContextWithKey, else a fresh idemkey.NewKey. The key goes in the request's
// header, so a retry that sends the same *connect.Request again carries the
// same key: use one Request per operation. A caller's key that is malformed
// fails the call with InvalidArgument (reason IDEMPOTENCY_KEY_INVALID)
// before it is sent. Streaming calls, and calls of handlers, pass through
// untouched.
//
// A procedure named in WithIncludedProcedures or WithExcludedProcedures that
// the protobuf registry does not know fails every call with Internal, naming
// it: a typo would otherwise leave the procedure's calls without keys.
func NewClientInterceptor(opts ...ClientOption) connect.Interceptor {
	o := newClientOptions(opts)
	return &client{procs: &procedures{cov: o.coverage}, err: checkProcedures(o.coverage, nil)}
}

type client struct {
	procs *procedures
	err   error // of the options
}

func (cl *client) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !req.Spec().IsClient {
			return next(ctx, req)
		}
		if cl.err != nil {
			return nil, connect.NewError(connect.CodeInternal, cl.err)
		}
		p := cl.procs.get(req.Spec())
		if !p.covered {
			return next(ctx, req)
		}
		h := req.Header()
		switch vs := h[idemkey.KeyHeader]; len(vs) {
		case 0:
			if msg, ok := req.Any().(proto.Message); ok && p.keyField != nil && protokey.KeyFromField(msg, p.keyField) != "" {
				break // the request carries its own key
			}
			key, ok := ctx.Value(contextKey{}).(string)
			if !ok {
				key = idemkey.NewKey()
			} else if err := checkKey(key); err != nil {
				return nil, err
			}
			h[idemkey.KeyHeader] = []string{idemkey.FormatKey(key)}
		case 1:
			if _, err := idemkey.ParseKey(vs[0]); err != nil {
				return nil, invalidKeyError(err.(*idemkey.KeyError).Problem)
			}
		default:
			return nil, invalidKeyError("it was sent more than once")
		}
		return next(ctx, req)
	}
}

func (cl *client) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (cl *client) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

type contextKey struct{}

// ContextWithKey returns a context whose calls through NewClientInterceptor
// carry key as their idempotency key, for example a key saved with the
// business record so that a restarted process retries the same operation.
// A key already in a request's header wins. Every call of a covered
// procedure made with the context carries it, so use one context per
// operation.
func ContextWithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, contextKey{}, key)
}
