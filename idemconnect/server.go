package idemconnect

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// NewServerInterceptor returns an interceptor for Connect handlers that runs
// each covered unary call at most once per idempotency key on eng, and
// replays its recorded outcome to every retry; streams pass through. It
// returns an error for mistakes to catch at start-up, as
// interceptor.UnaryServerInterceptor does.
func NewServerInterceptor(eng *engine.Engine, opts ...Option) (connect.Interceptor, error) {
	o := rpckit.NewSettings[FingerprintFunc, RedactFunc]()
	for _, opt := range opts {
		opt.applyServer(o)
	}
	if err := rpckit.Check(o.Coverage, naming, true, eng); err != nil {
		return nil, err
	}
	return &server{eng: eng, opts: o, procs: rpckit.NewMethods(o.Coverage, eng, "connectrpc")}, nil
}

// server translates Connect calls into the engine's request path and back.
type server struct {
	eng   *engine.Engine
	opts  *options
	procs *rpckit.Methods
}

func (s *server) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		p := procedure(s.procs, req.Spec())
		if !p.Covered {
			resp, err := next(ctx, req)
			if len(req.Header()[idemkey.KeyHeader]) > 0 {
				markIgnored(ctx, resp, err)
			}
			return resp, err
		}
		x := &exchange{s: s, ctx: ctx, req: req, p: p, next: next}
		s.eng.Serve(ctx, p.Op, x)
		return x.resp, x.err
	}
}

func (s *server) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (s *server) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.Code(statusOf(err).Code)
}

// exchange is one covered call, as engine.Serve reads and answers it.
type exchange struct {
	s     *server
	ctx   context.Context
	req   connect.AnyRequest
	p     *rpckit.Method
	next  connect.UnaryFunc
	resp  connect.AnyResponse
	err   error
	keyed bool // Key found one: Pass runs it unprotected (FailedOpen)
}

func (x *exchange) Key() (string, bool, error) {
	key, ok, err := requestKey(x.req, x.p)
	if err != nil {
		return "", false, err
	}
	x.keyed = ok
	return key, ok, nil // not a nil *connect.Error, which is a non-nil error
}

func (x *exchange) FirstSent() []string     { return x.req.Header()[idemkey.FirstSentHeader] }
func (x *exchange) FirstRegion() []string   { return x.req.Header()[idemkey.FirstRegionHeader] }
func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{Retried: retried(x.req.Header())} }

func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	fp, st, err := x.p.Fingerprint(ctx, x.s.eng.Logger(), x.req.Any(), x.s.opts.Fingerprint, isConnectError)
	if st != nil {
		return fp, toError(st)
	}
	return fp, err
}

func isConnectError(err error) bool {
	ce := (*connect.Error)(nil)
	return errors.As(err, &ce)
}

func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	var k *kept
	info, _ := connect.CallInfoForHandlerContext(ctx)
	if len(x.s.opts.Replayed) > 0 {
		k = newKept(x.s.opts.Replayed, info)
	}
	resp, err := x.next(ctx, x.req)
	if k != nil {
		if info != nil {
			k.add(&k.header, info.ResponseHeader(), "h:")
			k.add(&k.trailer, info.ResponseTrailer(), "t:")
		}
		if err == nil && resp != nil {
			k.add(&k.header, resp.Header(), "")
			k.add(&k.trailer, resp.Trailer(), "")
		} else if ce := (*connect.Error)(nil); errors.As(err, &ce) && !connect.IsWireError(err) {
			// gRPC sends an error's metadata as trailers; so does the record.
			// Connect drops it from a wire error, and so does the record.
			k.add(&k.trailer, ce.Meta(), "")
		}
	}
	if err == nil && resp == nil {
		err = toError(rpckit.Internal("idemkey: the handler returned no response and no error"))
	}
	x.resp, x.err = resp, err
	raw, record, encodeErr := x.encode(k)
	return engine.HandlerResult{Record: raw, Release: !record && encodeErr == nil, KeepWrites: err == nil, Unrecordable: encodeErr}
}

func (x *exchange) StandIn(why error) []byte {
	raw, _ := rpckit.StandIn(why)
	return raw
}

func (x *exchange) Pass(ctx context.Context) int {
	x.resp, x.err = x.next(ctx, x.req)
	if x.keyed {
		markIgnored(x.ctx, x.resp, x.err)
	}
	return int(codeOf(x.err))
}

func (x *exchange) Answer(_ context.Context, a engine.Answer) int {
	x.resp, x.err = x.answer(a)
	return int(codeOf(x.err))
}

func (x *exchange) answer(a engine.Answer) (connect.AnyResponse, error) {
	switch a.Verdict {
	case engine.Executed:
		if a.StandIn != nil {
			_, st := rpckit.StandIn(a.StandIn)
			err := withExpires(toError(st), a.Expires)
			err.Meta()[idemkey.ReplayedHeader] = []string{"false"}
			return nil, err
		}
		x.tellFirst(a.Expires)
		return x.resp, x.err
	case engine.Replayed:
		return x.replay(a)
	case engine.KeyInvalid, engine.Refused:
		return nil, a.Err // the key's, the TenantFunc's own, unchanged, or the fingerprint's, already a *connect.Error
	}
	err := toError(rpckit.Refusal(x.ctx, a, "set the "+idemkey.KeyHeader+" header to one random key per operation"))
	switch a.Verdict {
	case engine.InProgress:
		err.Meta()[retryAfterHeader] = []string{strconv.FormatInt(ceilDiv(a.RetryAfter, time.Second, 1), 10)}
		err.Meta()[pushbackHeader] = []string{strconv.FormatInt(ceilDiv(a.RetryAfter, time.Millisecond, 0), 10)}
		return nil, withExpires(err, a.Expires)
	case engine.Reused:
		return nil, withExpires(err, a.Expires)
	}
	return nil, err
}

// requestKey returns the call's key, from the header or the request's key
// field, which must agree.
func requestKey(req connect.AnyRequest, p *rpckit.Method) (string, bool, *connect.Error) {
	h := req.Header()
	key, ok, err := rpckit.TransportKey(h[idemkey.KeyHeader], len(h[idemkey.KeyHeader+"-Bin"]) > 0)
	if err == nil {
		key, ok, err = p.Key(key, ok, req.Any())
	}
	if err != nil {
		return "", false, toError(rpckit.InvalidKey(err))
	}
	return key, ok, nil
}

func retried(h http.Header) bool {
	v := h[attemptsHeader]
	return len(v) > 0 && v[0] != "0"
}

// tellFirst marks a first execution, with its expiry, where the replay
// marker goes (answerMeta; over gRPC and gRPC-Web, a reply's trailer too).
func (x *exchange) tellFirst(expires time.Time) {
	h := answerMeta(x.ctx, x.resp, x.err)
	if h == nil {
		return
	}
	setExpires(h, expires)
	h[idemkey.ReplayedHeader] = []string{"false"}
	if protocol := x.req.Peer().Protocol; x.err == nil && (protocol == connect.ProtocolGRPC || protocol == connect.ProtocolGRPCWeb) {
		if info, ok := connect.CallInfoForHandlerContext(x.ctx); ok {
			info.ResponseTrailer()[idemkey.ReplayedHeader] = []string{"false"}
		} else {
			x.resp.Trailer()[idemkey.ReplayedHeader] = []string{"false"}
		}
	}
}

// markIgnored marks a keyed call that ran unprotected.
func markIgnored(ctx context.Context, resp connect.AnyResponse, err error) {
	if h := answerMeta(ctx, resp, err); h != nil {
		h[idemkey.StatusHeader] = []string{idemkey.StatusIgnored}
	}
}

// answerMeta is where the answer's own fields go: the response header with
// a reply, the trailer with an error (a handler's *connect.Error may be
// shared among calls, so its metadata is left alone); nil if neither.
func answerMeta(ctx context.Context, resp connect.AnyResponse, err error) http.Header {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	switch {
	case ok && err != nil:
		return info.ResponseTrailer()
	case ok:
		return info.ResponseHeader()
	case err == nil && resp != nil:
		return resp.Header()
	}
	return nil
}

func setExpires(h http.Header, expires time.Time) {
	if !expires.IsZero() {
		h[idemkey.ExpiresHeader] = []string{idemkey.FormatDate(expires)}
	}
}

// withExpires puts the expiry in the metadata of err, one of idemkey's own:
// headers with Connect's protocol, trailers with gRPC's.
func withExpires(err *connect.Error, expires time.Time) *connect.Error {
	setExpires(err.Meta(), expires)
	return err
}

// replay marks a replayed reply by its header and, over gRPC and gRPC-Web,
// its trailer too, where grpc-go clients look for it; an error by its
// metadata.
func (x *exchange) replay(a engine.Answer) (connect.AnyResponse, error) {
	ctx, s := x.ctx, x.s
	rec, st := x.p.Read(ctx, s.eng.Logger(), a.Outcome)
	if st != nil {
		return nil, toError(st)
	}
	header, trailer := rpckit.Allowed(rec.Header, s.opts.Replayed), rpckit.Allowed(rec.Trailer, s.opts.Replayed)
	if rec.Status != nil {
		err := toError(rec.Status)
		if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
			addEntries(info.ResponseHeader(), header)
		} else {
			addEntries(err.Meta(), header)
		}
		addEntries(err.Meta(), trailer)
		err.Meta()[idemkey.ReplayedHeader] = []string{"true"}
		return nil, withExpires(err, a.Expires)
	}
	resp := connect.NewResponse(&replayedMessage{rec.Response})
	addEntries(resp.Header(), header)
	addEntries(resp.Trailer(), trailer)
	resp.Header()[idemkey.ReplayedHeader] = []string{"true"}
	setExpires(resp.Header(), a.Expires)
	if protocol := x.req.Peer().Protocol; protocol == connect.ProtocolGRPC || protocol == connect.ProtocolGRPCWeb {
		resp.Trailer()[idemkey.ReplayedHeader] = []string{"true"}
	}
	return resp, nil
}
