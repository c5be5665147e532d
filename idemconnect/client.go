package idemconnect

import (
	"context"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/protokey/rpckit"
)

// NewClientInterceptor returns an interceptor for Connect clients that
// attaches an idempotency key to every call of a covered procedure: the one
// already in the request's Idempotency-Key header, else the one of
// idemkey.ContextWithKey, else a fresh idemkey.NewKey. Beside it goes when the
// operation was first sent (Idempotency-First-Sent), unless the request has
// it: the time of idemkey.ContextWithKeyFirstSent, else now. Both go in the
// request's header, so a retry that sends the same *connect.Request again
// carries the same key and the same first-sent time: use one Request per
// operation. The context's first-sent time goes only with the context's
// key: a request that carries its own key in the header or the key field
// is sent now as its first time, unless its header says otherwise. Both go
// in the strict forms of
// draft-ietf-httpapi-idempotency-key-header-07, which a strict server
// reads: the key as an RFC 8941 string (idemkey.FormatKey, in double
// quotes), the time as an IMF-fixdate (idemkey.FormatDate); a key or time
// already in the header in another form, such as a bare key, is rewritten
// to the same key or time in those. A caller's key or first-sent time that is malformed fails the
// call with InvalidArgument (reason IDEMPOTENCY_KEY_INVALID or
// IDEMPOTENCY_FIRST_SENT_INVALID) before it is sent. Streaming calls, and
// calls of handlers, pass through untouched.
//
// A procedure named in WithIncludedProcedures or WithExcludedProcedures that
// the protobuf registry does not know fails every call with Internal, naming
// it: a typo would otherwise leave the procedure's calls without keys.
func NewClientInterceptor(opts ...ProcedureOption) connect.Interceptor {
	var cov rpckit.Coverage
	for _, opt := range opts {
		opt.applyClient(&cov)
	}
	return &client{procs: rpckit.NewMethods(cov, nil, ""), err: rpckit.Check(cov, naming, false, nil)}
}

type client struct {
	procs *rpckit.Methods
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
		p := procedure(cl.procs, req.Spec())
		if !p.Covered {
			return next(ctx, req)
		}
		h := req.Header()
		var ctxSent time.Time // the context's first-sent time, sent only with its key
		switch vs := h[idemkey.KeyHeader]; len(vs) {
		case 0:
			if msg, ok := req.Any().(proto.Message); ok && p.KeyField != nil && protokey.KeyFromField(msg, p.KeyField) != "" {
				break // the request carries its own key
			}
			key, sent, ok := idemkey.KeyFromContext(ctx)
			ctxSent = sent
			if !ok {
				key = idemkey.NewKey()
			} else if err := checkKey(key); err != nil {
				return nil, err
			}
			h[idemkey.KeyHeader] = []string{idemkey.FormatKey(key)}
		default:
			key, _, err := rpckit.TransportKey(vs, false)
			if err != nil {
				return nil, toError(rpckit.InvalidKey(err))
			}
			vs[0] = idemkey.FormatKey(key) // the same key, as the strict form
		}
		if err := setFirstSent(h, ctxSent); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

// setFirstSent sets idemkey.FirstSentHeader in h, unless h has it: to
// ctxSent, the time of idemkey.ContextWithKeyFirstSent when the call sends
// that context's key, else now. One h has is sent as the IMF-fixdate of its
// time; one that is not an HTTP date, or that is sent twice, fails the call
// before it is sent.
func setFirstSent(h http.Header, ctxSent time.Time) *connect.Error {
	switch vs := h[idemkey.FirstSentHeader]; len(vs) {
	case 0:
		t := ctxSent
		if t.IsZero() {
			t = time.Now()
		}
		h[idemkey.FirstSentHeader] = []string{idemkey.FormatDate(t)}
	case 1:
		t, err := idemkey.ParseDate(vs[0])
		if err != nil {
			return firstSentInvalidError("it is not an HTTP date")
		}
		vs[0] = idemkey.FormatDate(t) // the same time, as an IMF-fixdate
	default:
		return firstSentInvalidError("it was sent more than once")
	}
	return nil
}

func (cl *client) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (cl *client) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// firstSentInvalidError is the InvalidArgument error for a first-sent time
// that is malformed or sent more than once; problem says which and must not
// quote the value.
func firstSentInvalidError(problem string) *connect.Error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first-sent time refused: "+problem))
}
