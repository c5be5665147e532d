package idemconnect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

// NewServerInterceptor returns an interceptor for Connect handlers that runs
// each covered unary call at most once per idempotency key on eng, and
// replays its recorded outcome to every retry. Streaming calls, and calls of
// clients, pass through untouched. eng holds the settings every entry point
// shares (engine.New: the store, the tenant, leases, retention, sealing,
// hooks, metrics); opts are the Connect adapter's own.
//
// It returns an error for mistakes to catch at start-up: a nil eng, an
// engine that cannot tell tenants apart (engine.WithTenant or
// engine.WithSingleTenant), WithAtomic or WithAtomicProcedures on a store
// that does not implement store.Atomic, or a procedure named in
// WithIncludedProcedures, WithExcludedProcedures or WithAtomicProcedures
// that the protobuf registry does not know (or, for WithAtomicProcedures,
// that is not covered).
func NewServerInterceptor(eng *engine.Engine, opts ...Option) (connect.Interceptor, error) {
	if eng == nil {
		return nil, errors.New("idemkey: NewServerInterceptor needs an engine: engine.New(store, engine.WithTenant(...))")
	}
	o := newOptions(opts)
	if err := checkProcedures(o.coverage, o.atomic); err != nil {
		return nil, err
	}
	if _, err := eng.Operation(engine.OperationSpec{Atomic: o.atomicAll || len(o.atomic) > 0}); err != nil {
		return nil, err
	}
	return &server{eng: eng, opts: o, procs: &procedures{cov: o.coverage, atomicAll: o.atomicAll, atomic: o.atomic, eng: eng}}, nil
}

// server translates Connect calls into the engine's request path and back:
// where the key comes from (the Idempotency-Key header), how the request is
// fingerprinted, and how an outcome is recorded (outcome.go) and replayed.
type server struct {
	eng   *engine.Engine
	opts  *options
	procs *procedures
}

func (s *server) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		p := s.procs.get(req.Spec())
		if !p.covered {
			return next(ctx, req)
		}
		x := &exchange{s: s, ctx: ctx, req: req, p: p, next: next}
		s.eng.Serve(ctx, p.op, x)
		return x.resp, x.err
	}
}

func (s *server) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (s *server) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// codeOf is the code Connect sends for err.
func codeOf(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.Code(statusOf(err).Code)
}

// exchange is one covered call, as engine.Serve reads and answers it; resp
// and err are its answer.
type exchange struct {
	s    *server
	ctx  context.Context
	req  connect.AnyRequest
	p    *procedure
	next connect.UnaryFunc

	resp connect.AnyResponse
	err  error
}

func (x *exchange) Key() (string, bool, error) {
	key, ok, err := requestKey(x.req, x.p)
	if err != nil {
		return "", false, err
	}
	return key, ok, nil // not a nil *connect.Error, which is a non-nil error
}

func (x *exchange) FirstSent() []string { return x.req.Header()[idemkey.FirstSentHeader] }

func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{Retried: retried(x.req.Header())} }

func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	p := x.p
	if p.output == nil {
		return store.Fingerprint{}, internalError("idemkey: the procedure is not in the protobuf registry, so its replies cannot be replayed")
	}
	msg, ok := x.req.Any().(proto.Message)
	if !ok {
		return store.Fingerprint{}, internalError("idemkey: the request is not a protobuf message")
	}
	var fp store.Fingerprint
	var err error
	if x.s.opts.fingerprint == nil {
		fp, err = protokey.HashRequestWithout(p.name, msg, p.keyField)
	} else {
		fp, err = x.s.opts.fingerprint(p.name, msg)
	}
	if err != nil {
		if ce := (*connect.Error)(nil); errors.As(err, &ce) {
			return fp, err
		}
		// The FingerprintFunc's own words may quote the request.
		x.s.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: fingerprint failed", slog.String("operation", p.name),
			slog.String("error", fmt.Sprintf("an error of type %T (its words are not logged: they may quote the request)", err)))
		return fp, internalError("idemkey: the request could not be fingerprinted")
	}
	return fp, nil
}

// Run runs the handler, keeping the allow-listed headers and trailers it
// sets (WithReplayedHeaders), and encodes its result for the record.
func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	var k *kept
	info, _ := connect.CallInfoForHandlerContext(ctx)
	if len(x.s.opts.replayed) > 0 {
		k = newKept(x.s.opts.replayed, info)
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
		err = internalError("idemkey: the handler returned no response and no error")
	}
	x.resp, x.err = resp, err
	raw, record, encodeErr := encodeOutcome(x.ctx, x.p.name, resp, err, x.s.opts.recorded, k, x.s.opts.redact)
	return engine.HandlerResult{Record: raw, Release: !record && encodeErr == nil, KeepWrites: err == nil, Unrecordable: encodeErr}
}

func (x *exchange) StandIn(why error) []byte {
	switch {
	case errors.Is(why, engine.ErrTooLarge):
		return tooLarge
	case errors.Is(why, store.ErrFull):
		return noRoom
	}
	return unrecordable
}

func (x *exchange) Pass(ctx context.Context) int {
	x.resp, x.err = x.next(ctx, x.req)
	return int(codeOf(x.err))
}

func (x *exchange) Answer(_ context.Context, a engine.Answer) int {
	x.resp, x.err = x.answer(a)
	return int(codeOf(x.err))
}

// answer is the response and error of a.
func (x *exchange) answer(a engine.Answer) (connect.AnyResponse, error) {
	ctx := x.ctx
	switch a.Verdict {
	case engine.Executed:
		if a.StandIn != nil {
			return nil, withExpires(standInError(a.StandIn), a.Expires)
		}
		tellExpires(ctx, a.Expires, x.resp, x.err)
		return x.resp, x.err
	case engine.Replayed:
		return x.replay(a)
	case engine.InProgress:
		return nil, withExpires(inProgressError(a.RetryAfter), a.Expires)
	case engine.Reused:
		return nil, withExpires(reusedKeyError(), a.Expires)
	case engine.KeyMissing:
		return nil, missingKeyError()
	case engine.KeyInvalid:
		return nil, a.Err // requestKey's, already a *connect.Error
	case engine.Refused:
		return nil, a.Err // the TenantFunc's own, unchanged, or the fingerprint's, already a *connect.Error
	case engine.Expired:
		return nil, keyExpiredError()
	case engine.FirstSentInvalid:
		return nil, firstSentInvalidError(a.Err)
	case engine.StoreFull:
		return nil, storeFullError(a.RetryAfter)
	}
	if err := ctx.Err(); err != nil {
		return nil, connect.NewError(connect.Code(statusOf(err).Code), err)
	}
	return nil, storeUnavailableError()
}

// standInError is the Internal answered with the stand-in recorded in
// place of a reply that cannot be recorded (why: Exchange.StandIn's), with
// the stand-in's message.
func standInError(why error) *connect.Error {
	switch {
	case errors.Is(why, engine.ErrTooLarge):
		return internalError(tooLargeMsg)
	case errors.Is(why, store.ErrFull):
		return internalError(noRoomMsg)
	}
	return internalError(unrecordableMsg)
}

// requestKey returns the call's idempotency key: from the header, or from
// the request's key field (WithKeyField), which must then agree with the
// header if that carries one too.
func requestKey(req connect.AnyRequest, p *procedure) (string, bool, *connect.Error) {
	key, ok, err := keyFromHeader(req.Header())
	if err != nil || p.keyField == nil {
		return key, ok, err
	}
	msg, _ := req.Any().(proto.Message)
	key, ok, ferr := protokey.RequestKey(key, ok, msg, p.keyField)
	if ferr != nil {
		return "", false, invalidKeyError(ferr.(*idemkey.KeyError).Problem)
	}
	return key, ok, nil
}

// keyFromHeader returns the idempotency key of h, read by idemkey.ParseKey
// as every entry point reads it, over each of Connect's protocols. ok is
// false when h carries none. A key that is malformed, sent more than once
// (two header lines, or two gRPC metadata values) or sent as binary metadata
// is an error that never quotes the key.
func keyFromHeader(h http.Header) (key string, ok bool, err *connect.Error) {
	if len(h[idemkey.KeyHeader+"-Bin"]) > 0 {
		return "", false, invalidKeyError("it was sent as binary metadata")
	}
	switch vs := h[idemkey.KeyHeader]; len(vs) {
	case 0:
		return "", false, nil
	case 1:
		key, err := idemkey.ParseKey(vs[0])
		if err != nil {
			return "", false, invalidKeyError(err.(*idemkey.KeyError).Problem)
		}
		return key, true, nil
	default:
		return "", false, invalidKeyError("it was sent more than once")
	}
}

// retried reports whether gRPC's retry policy marks the call as a later
// attempt, as it does over Connect's gRPC protocol too.
func retried(h http.Header) bool {
	v := h[attemptsHeader]
	return len(v) > 0 && v[0] != "0"
}

// tellExpires tells the client until when the key of a call whose reply the
// handler made is honoured, once that reply is recorded: in the call's
// response header with a reply, and its trailer with an error, where
// withExpires puts it too. A handler's *connect.Error may be shared among
// calls, so its metadata is left alone.
func tellExpires(ctx context.Context, expires time.Time, resp connect.AnyResponse, err error) {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	switch {
	case ok && err != nil:
		setExpires(info.ResponseTrailer(), expires)
	case ok:
		setExpires(info.ResponseHeader(), expires)
	case err == nil:
		setExpires(resp.Header(), expires)
	}
}

// setExpires sets idemkey.ExpiresHeader in h to expires, until when the
// call's key is honoured, if the store said.
func setExpires(h http.Header, expires time.Time) {
	if !expires.IsZero() {
		h[idemkey.ExpiresHeader] = []string{idemkey.FormatDate(expires)}
	}
}

// withExpires is err, one of idemkey's own, with the call's expiry in its
// metadata: headers with Connect's protocol, trailers with gRPC's, as the
// gRPC interceptor sends it.
func withExpires(err *connect.Error, expires time.Time) *connect.Error {
	setExpires(err.Meta(), expires)
	return err
}

// replay answers a retry with the recorded outcome, marked replayed: a reply
// by the header Idempotent-Replayed and, over gRPC and gRPC-Web, the trailer
// too, where grpc-go clients look for it; an error by its metadata, which
// Connect sends as headers with its own protocol and as trailers with gRPC's.
func (x *exchange) replay(a engine.Answer) (connect.AnyResponse, error) {
	ctx, s, p := x.ctx, x.s, x.p
	rec, err := decodeOutcome(a.Outcome, p.output)
	if err != nil {
		s.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: recorded outcome is corrupt",
			slog.String("operation", p.name), slog.Any("error", err))
		return nil, internalError("idemkey: the recorded outcome of this call cannot be read")
	}
	// The allow-list of today applies, not the one the record was made under.
	if rec.err != nil {
		if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
			addEntries(info.ResponseHeader(), rec.header, s.opts.replayed)
		} else {
			addEntries(rec.err.Meta(), rec.header, s.opts.replayed)
		}
		addEntries(rec.err.Meta(), rec.trailer, s.opts.replayed)
		rec.err.Meta()[idemkey.ReplayedHeader] = []string{"true"}
		return nil, withExpires(rec.err, a.Expires)
	}
	resp := connect.NewResponse(&replayedMessage{rec.resp})
	addEntries(resp.Header(), rec.header, s.opts.replayed)
	addEntries(resp.Trailer(), rec.trailer, s.opts.replayed)
	resp.Header()[idemkey.ReplayedHeader] = []string{"true"}
	setExpires(resp.Header(), a.Expires)
	if protocol := x.req.Peer().Protocol; protocol == connect.ProtocolGRPC || protocol == connect.ProtocolGRPCWeb {
		resp.Trailer()[idemkey.ReplayedHeader] = []string{"true"}
	}
	return resp, nil
}
