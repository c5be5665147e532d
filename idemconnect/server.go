package idemconnect

import (
	"context"
	"errors"
	"log/slog"
	"net/http"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

// NewServerInterceptor returns an interceptor for Connect handlers that runs
// each covered unary call at most once per idempotency key on st, and
// replays its recorded outcome to every retry. Streaming calls, and calls of
// clients, pass through untouched. Among opts are the settings every entry
// point shares (tenant, key required, lease, retention, fail-open, record
// size, logger, metrics).
//
// It returns an error for mistakes to catch at start-up: WithAtomic or
// WithAtomicProcedures on a store that does not implement store.Atomic, or
// a procedure named in WithIncludedProcedures, WithExcludedProcedures or
// WithAtomicProcedures that the protobuf registry does not know (or, for
// WithAtomicProcedures, that is not covered).
func NewServerInterceptor(st store.Store, opts ...Option) (connect.Interceptor, error) {
	if st == nil {
		return nil, errors.New("idemkey: NewServerInterceptor needs a store")
	}
	o := newOptions(opts)
	if err := checkProcedures(o.coverage, o.atomic); err != nil {
		return nil, err
	}
	eng := engine.New(st, o.engine...)
	if o.atomicAll || len(o.atomic) > 0 {
		if _, err := eng.Operation(engine.OperationSpec{Atomic: true}); err != nil {
			return nil, err
		}
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
		c := s.eng.Call(p.op)
		resp, err := s.serve(ctx, req, p, next, &c)
		c.End(ctx, int(codeOf(err)))
		return resp, err
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

// serve is the interceptor for a covered procedure; it sets c.Verdict to what
// became of the call.
func (s *server) serve(ctx context.Context, req connect.AnyRequest, p *procedure, next connect.UnaryFunc, c *engine.Call) (connect.AnyResponse, error) {
	key, ok, kerr := requestKey(req, p)
	if kerr != nil {
		c.Verdict = engine.KeyInvalid
		return nil, kerr
	}
	if !ok {
		if s.eng.KeyRequired() {
			c.Verdict = engine.KeyMissing
			return nil, missingKeyError()
		}
		c.Verdict = engine.NoKey
		return next(ctx, req)
	}
	firstSent, err := s.eng.FirstSent(req.Header()[idemkey.FirstSentHeader])
	if err != nil {
		c.Verdict = engine.FirstSentInvalid
		return nil, firstSentInvalidError(err)
	}
	if p.output == nil {
		return nil, internalError("idemkey: the procedure is not in the protobuf registry, so its replies cannot be replayed")
	}
	msg, ok := req.Any().(proto.Message)
	if !ok {
		return nil, internalError("idemkey: the request is not a protobuf message")
	}
	tenant, err := s.eng.Tenant(ctx)
	if err != nil {
		return nil, err
	}
	var fp store.Fingerprint
	if s.opts.fingerprint == nil {
		fp, err = protokey.HashRequestWithout(p.name, msg, p.keyField)
	} else {
		fp, err = s.opts.fingerprint(p.name, msg)
	}
	if err != nil {
		if ce := (*connect.Error)(nil); errors.As(err, &ce) {
			return nil, err
		}
		c.Log(ctx, slog.LevelError, "fingerprint failed", err)
		return nil, internalError("idemkey: the request could not be fingerprinted")
	}

	c.Start(ctx, engine.Request{Tenant: tenant, Key: key, Fingerprint: fp, Retried: retried(req.Header()), FirstSent: firstSent})
	switch c.Verdict {
	case engine.Executed:
		return s.run(ctx, c, p, req, next)
	case engine.FailedOpen:
		return next(c.Context(ctx), req)
	}
	return s.answer(ctx, c, p, req)
}

// answer answers a call that did not run the handler, as c.Verdict says.
func (s *server) answer(ctx context.Context, c *engine.Call, p *procedure, req connect.AnyRequest) (connect.AnyResponse, error) {
	switch c.Verdict {
	case engine.Replayed:
		return s.replay(ctx, c, p, req)
	case engine.InProgress:
		return nil, withExpires(inProgressError(c.RetryAfter), c)
	case engine.Reused:
		return nil, withExpires(reusedKeyError(), c)
	case engine.Expired:
		return nil, keyExpiredError()
	case engine.FirstSentInvalid: // Start's own check, which the one before it makes unlikely
		return nil, firstSentInvalidError(&engine.FirstSentError{Problem: "it lies in the future, beyond the clock skew allowed"})
	case engine.StoreFull:
		return nil, storeFullError(c.RetryAfter)
	}
	if err := ctx.Err(); err != nil {
		return nil, connect.NewError(connect.Code(statusOf(err).Code), err)
	}
	return nil, storeUnavailableError()
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

// run runs the handler for an acquired key, then records its outcome or
// releases the key. In atomic mode only a success keeps the handler's
// writes: a recorded error, or a reply that could not be recorded, undoes
// them.
func (s *server) run(ctx context.Context, c *engine.Call, p *procedure, req connect.AnyRequest, next connect.UnaryFunc) (connect.AnyResponse, error) {
	var k *kept
	info, _ := connect.CallInfoForHandlerContext(ctx)
	if len(s.opts.replayed) > 0 {
		k = newKept(s.opts.replayed, info)
	}
	defer c.Abandon(ctx) // the handler panicked: let a retry run again
	resp, err := next(c.Context(ctx), req)
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

	outcome, record, encodeErr := encodeOutcome(ctx, req.Spec().Procedure, resp, err, s.opts.recorded, k, s.opts.redact)
	if encodeErr != nil {
		c.Log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead", encodeErr)
		return s.recordInstead(ctx, c, p, req, unrecordable, unrecordableMsg)
	}
	if !record {
		c.Release(ctx)
		return resp, err
	}
	switch recErr := c.Record(ctx, outcome, err == nil); {
	case errors.Is(recErr, engine.ErrTooLarge):
		return s.recordInstead(ctx, c, p, req, tooLarge, tooLargeMsg)
	case errors.Is(recErr, store.ErrFull):
		return s.recordInstead(ctx, c, p, req, noRoom, noRoomMsg)
	case errors.Is(recErr, engine.ErrSuperseded):
		return s.answer(ctx, c, p, req)
	case recErr != nil:
		return nil, storeUnavailableError()
	}
	tellExpires(ctx, c, resp, err)
	return resp, err
}

// tellExpires tells the client until when the key of a call whose reply the
// handler made is honoured, once that reply is recorded: in the call's
// response header with a reply, and its trailer with an error, where
// withExpires puts it too. A handler's *connect.Error may be shared among
// calls, so its metadata is left alone.
func tellExpires(ctx context.Context, c *engine.Call, resp connect.AnyResponse, err error) {
	info, ok := connect.CallInfoForHandlerContext(ctx)
	switch {
	case ok && err != nil:
		setExpires(info.ResponseTrailer(), c)
	case ok:
		setExpires(info.ResponseHeader(), c)
	case err == nil:
		setExpires(resp.Header(), c)
	}
}

// setExpires sets idemkey.ExpiresHeader in h to the call's expiry, if the
// store said.
func setExpires(h http.Header, c *engine.Call) {
	if !c.Expires.IsZero() {
		h[idemkey.ExpiresHeader] = []string{idemkey.FormatDate(c.Expires)}
	}
}

// withExpires is err, one of idemkey's own, with the call's expiry in its
// metadata: headers with Connect's protocol, trailers with gRPC's, as the
// gRPC interceptor sends it.
func withExpires(err *connect.Error, c *engine.Call) *connect.Error {
	setExpires(err.Meta(), c)
	return err
}

// recordInstead records a short Internal in place of a reply that cannot be
// recorded: the handler has run, so its key must not be released. The caller
// gets it too, as every retry will; if even it cannot be recorded, the key
// stays in progress until its lease ends. Only in atomic mode, where a
// failed commit undoes the handler's writes, is the answer Unavailable.
func (s *server) recordInstead(ctx context.Context, c *engine.Call, p *procedure, req connect.AnyRequest, outcome []byte, msg string) (connect.AnyResponse, error) {
	switch recErr := c.Record(ctx, outcome, false); {
	case errors.Is(recErr, engine.ErrSuperseded):
		return s.answer(ctx, c, p, req)
	case recErr != nil && c.Atomic():
		return nil, storeUnavailableError()
	case recErr != nil:
		return nil, internalError(msg)
	}
	return nil, withExpires(internalError(msg), c)
}

// replay answers a retry with the recorded outcome, marked replayed: a reply
// by the header Idempotent-Replayed and, over gRPC and gRPC-Web, the trailer
// too, where grpc-go clients look for it; an error by its metadata, which
// Connect sends as headers with its own protocol and as trailers with gRPC's.
func (s *server) replay(ctx context.Context, c *engine.Call, p *procedure, req connect.AnyRequest) (connect.AnyResponse, error) {
	rec, err := decodeOutcome(c.Outcome, p.output)
	if err != nil {
		c.Log(ctx, slog.LevelError, "recorded outcome is corrupt", err)
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
		return nil, withExpires(rec.err, c)
	}
	resp := connect.NewResponse(&replayedMessage{rec.resp})
	addEntries(resp.Header(), rec.header, s.opts.replayed)
	addEntries(resp.Trailer(), rec.trailer, s.opts.replayed)
	resp.Header()[idemkey.ReplayedHeader] = []string{"true"}
	setExpires(resp.Header(), c)
	if protocol := req.Peer().Protocol; protocol == connect.ProtocolGRPC || protocol == connect.ProtocolGRPCWeb {
		resp.Trailer()[idemkey.ReplayedHeader] = []string{"true"}
	}
	return resp, nil
}
