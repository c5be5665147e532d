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

// NewClientInterceptor returns an interceptor for Connect clients that gives
// every call of a covered procedure an idempotency key and first-sent time:
// the request header's, else idemkey.ContextWithKey's, else a new key and
// now; and the first region idemkey.ContextWithKeyFirstRegion gives with
// its key, or the header's, checked. They go in the request's header, in the strict forms a strict server
// reads (idemkey.FormatKey, idemkey.FormatDate), so a retry of the same
// *connect.Request resends them: use one Request per operation. A malformed
// key or time fails the call with InvalidArgument before it is sent.
// A procedure an option names that the protobuf registry does not know fails
// every call with Internal: a typo would otherwise send calls without keys.
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
		var ctxRegion string  // and its first region
		switch vs := h[idemkey.KeyHeader]; len(vs) {
		case 0:
			if msg, ok := req.Any().(proto.Message); ok && p.KeyField != nil && protokey.KeyFromField(msg, p.KeyField) != "" {
				break // the request carries its own key
			}
			key, sent, ok := idemkey.KeyFromContext(ctx)
			ctxSent, ctxRegion = sent, idemkey.FirstRegionFromContext(ctx)
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
		timed := len(h[idemkey.FirstSentHeader]) > 0 || !ctxSent.IsZero() // else sent as now
		if err := setFirstSent(h, ctxSent); err != nil {
			return nil, err
		}
		if err := setFirstRegion(h, ctxRegion, timed); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

// setFirstSent sets h's first-sent time, unless h has one, to ctxSent or
// now; one h has is checked and rewritten as an IMF-fixdate.
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

// setFirstRegion sets h's first region, unless h has one, to ctxRegion if
// not ""; one h has is checked (rpckit.FirstRegionProblem), timed telling
// whether the first-sent time was given.
func setFirstRegion(h http.Header, ctxRegion string, timed bool) *connect.Error {
	switch vs := h[idemkey.FirstRegionHeader]; len(vs) {
	case 0:
		if ctxRegion == "" {
			return nil
		}
		if problem := rpckit.FirstRegionProblem(ctxRegion, timed); problem != "" {
			return firstRegionInvalidError(problem)
		}
		h[idemkey.FirstRegionHeader] = []string{ctxRegion}
	case 1:
		if problem := rpckit.FirstRegionProblem(vs[0], timed); problem != "" {
			return firstRegionInvalidError(problem)
		}
	default:
		return firstRegionInvalidError("it was sent more than once")
	}
	return nil
}

func (cl *client) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (cl *client) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// firstRegionInvalidError refuses a first region with the first-sent
// time's reason; problem must not quote the value.
func firstRegionInvalidError(problem string) *connect.Error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first region refused: "+problem))
}

// firstSentInvalidError's problem must not quote the value.
func firstSentInvalidError(problem string) *connect.Error {
	return toError(rpckit.Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first-sent time refused: "+problem))
}
