package interceptor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

// UnaryServerInterceptor returns a server interceptor that runs each covered
// call at most once per idempotency key on eng, and replays its recorded
// outcome to every retry. eng holds the settings every entry point shares
// (engine.New: the store, the tenant, leases, retention, sealing, hooks,
// metrics); opts are the gRPC adapter's own. See the package documentation
// for the request path.
//
// It returns an error for a mistake to catch at start-up: a nil eng, an
// engine that cannot tell tenants apart (engine.WithTenant or
// engine.WithSingleTenant), WithAtomic or WithAtomicMethods on a store that
// does not implement store.Atomic, or a method named in WithIncludedMethods,
// WithExcludedMethods or WithAtomicMethods that the protobuf registry does
// not know (or, for WithAtomicMethods, that is not covered).
func UnaryServerInterceptor(eng *engine.Engine, opts ...Option) (grpc.UnaryServerInterceptor, error) {
	if eng == nil {
		return nil, errors.New("idemkey: UnaryServerInterceptor needs an engine: engine.New(store, engine.WithTenant(...))")
	}
	o := newOptions(opts)
	if err := checkMethods(o); err != nil {
		return nil, err
	}
	if _, err := eng.Operation(engine.OperationSpec{Atomic: o.atomicAll || len(o.atomic) > 0}); err != nil {
		return nil, err
	}
	s := &server{eng: eng, opts: o, methods: &methods{opts: o, eng: eng}}
	return s.intercept, nil
}

// server translates gRPC calls into the engine's request path and back:
// where the key comes from (metadata), how the request is fingerprinted
// (protokey.HashRequest), and how an outcome is recorded (outcome.go) and replayed.
type server struct {
	eng      *engine.Engine
	opts     *options
	methods  *methods
	trailers trailers
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := s.methods.get(info.FullMethod)
	if !m.covered {
		return handler(ctx, req)
	}
	x := &exchange{s: s, ctx: ctx, req: req, m: m, handler: handler}
	s.eng.Serve(ctx, m.op, x)
	return x.resp, x.err
}

// exchange is one covered call, as engine.Serve reads and answers it; resp
// and err are its answer.
type exchange struct {
	s       *server
	ctx     context.Context
	req     any
	m       *method
	handler grpc.UnaryHandler
	rec     *recorder // the metadata the handler set, when some is replayed
	expires [1]string // the value of the expiry's trailer (expiry)

	resp any
	err  error
}

func (x *exchange) Key() (string, bool, error) { return x.s.key(x.ctx, x.req, x.m) }

func (x *exchange) FirstSent() []string {
	return metadata.ValueFromIncomingContext(x.ctx, idemkey.FirstSentMetadata)
}

func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{Retried: retried(x.ctx)} }

func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	m := x.m
	if m.output == nil {
		return store.Fingerprint{}, status.Error(codes.Internal, "idemkey: the method is not in the protobuf registry, so its replies cannot be replayed")
	}
	msg, ok := x.req.(proto.Message)
	if !ok {
		return store.Fingerprint{}, status.Error(codes.Internal, "idemkey: the request is not a protobuf message")
	}
	var fp store.Fingerprint
	var err error
	if x.s.opts.fingerprint == nil {
		fp, err = protokey.HashRequestWithout(m.name, msg, m.keyField)
	} else {
		fp, err = x.s.opts.fingerprint(m.name, msg)
	}
	if err != nil {
		if _, isStatus := status.FromError(err); isStatus {
			return fp, err
		}
		// The FingerprintFunc's own words may quote the request.
		x.s.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: fingerprint failed", slog.String("operation", m.name),
			slog.String("error", fmt.Sprintf("an error of type %T (its words are not logged: they may quote the request)", err)))
		return fp, status.Error(codes.Internal, "idemkey: the request could not be fingerprinted")
	}
	return fp, nil
}

func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	ctx = x.handlerContext(ctx)
	x.resp, x.err = x.handler(ctx, x.req)
	raw, record, err := encodeOutcome(x.ctx, x.m.name, x.resp, x.err, x.s.opts.recorded, x.rec, x.s.opts.redact)
	return engine.HandlerResult{Record: raw, Release: !record && err == nil, KeepWrites: x.err == nil, Unrecordable: err}
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
	x.resp, x.err = x.handler(x.handlerContext(ctx), x.req)
	return int(status.Code(x.err))
}

func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	x.resp, x.err = x.answer(a)
	return int(status.Code(x.err))
}

// answer is the reply and error of a.
func (x *exchange) answer(a engine.Answer) (any, error) {
	ctx := x.ctx
	switch a.Verdict {
	case engine.Executed:
		x.tellExpiry(a.Expires, true)
		switch {
		case errors.Is(a.StandIn, engine.ErrTooLarge):
			return nil, tooLargeErr
		case errors.Is(a.StandIn, store.ErrFull):
			return nil, noRoomErr
		case a.StandIn != nil:
			return nil, unrecordableErr
		}
		return x.resp, x.err
	case engine.Replayed:
		return x.replay(a)
	case engine.InProgress:
		// Only a trailer: a retry policy does not retry a reply with headers.
		_ = grpc.SetTrailer(ctx, pushbackTrailer(a.RetryAfter))
		x.tellExpiry(a.Expires, false)
		return nil, inProgressError(a.RetryAfter)
	case engine.Reused:
		x.tellExpiry(a.Expires, false)
		return nil, reusedKeyError()
	case engine.KeyMissing:
		return nil, missingKeyError(ctx)
	case engine.KeyInvalid, engine.Refused:
		return nil, a.Err // the key's, the tenant's or the fingerprint's, already a status
	case engine.Expired:
		return nil, keyExpiredError()
	case engine.FirstSentInvalid:
		return nil, firstSentError(a.Err)
	case engine.StoreFull:
		return nil, storeFullError(a.RetryAfter)
	}
	if ctx.Err() != nil {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	return nil, storeUnavailableError()
}

// key returns the call's idempotency key: from the metadata, or from the
// request's key field (WithKeyField), which must then agree with the
// metadata if that carries one too.
func (s *server) key(ctx context.Context, req any, m *method) (string, bool, error) {
	key, ok, err := KeyFromIncomingContext(ctx)
	if err != nil || m.keyField == nil {
		return key, ok, err
	}
	msg, _ := req.(proto.Message)
	key, ok, err = protokey.RequestKey(key, ok, msg, m.keyField)
	if err != nil {
		return "", false, invalidKeyError(err.(*idemkey.KeyError).Problem)
	}
	return key, ok, nil
}

// retried reports whether gRPC's retry policy marks the call as a later
// attempt (AttemptsMetadata above 0).
func retried(ctx context.Context) bool {
	attempts := metadata.ValueFromIncomingContext(ctx, AttemptsMetadata)
	return len(attempts) > 0 && attempts[0] != "0"
}

// handlerContext is ctx, the engine's context for the handler, with the
// recorder that keeps the metadata the handler sets if some is replayed.
func (x *exchange) handlerContext(ctx context.Context) context.Context {
	if len(x.s.opts.replayed) > 0 {
		if ts := grpc.ServerTransportStreamFromContext(ctx); ts != nil {
			x.rec = &recorder{ServerTransportStream: ts, allowed: x.s.opts.replayed}
			ctx = grpc.NewContextWithServerTransportStream(ctx, x.rec)
		}
	}
	return ctx
}

// replay answers a retry with the recorded outcome.
func (x *exchange) replay(a engine.Answer) (any, error) {
	ctx, s := x.ctx, x.s
	rec, err := decodeOutcome(a.Outcome, x.m.output)
	if err != nil {
		s.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: recorded outcome is corrupt",
			slog.String("operation", x.m.name), slog.Any("error", err))
		return nil, status.Error(codes.Internal, "idemkey: the recorded outcome of this call cannot be read")
	}
	// The allow-list of today applies, not the one the record was made under.
	if md := allowed(rec.header, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	if md := allowed(rec.trailer, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetTrailer(ctx, md)
	}
	// One trailer with both: gRPC joins each trailer it is set into a copy.
	md := replayedTrailer
	if !a.Expires.IsZero() {
		if kept := s.trailers.of(a.Expires); kept != nil {
			md = kept.replay
		} else {
			md = metadata.MD{idemkey.ReplayedMetadata: replayedValue, idemkey.ExpiresMetadata: x.expiry(a.Expires)}
		}
	}
	_ = grpc.SetTrailer(ctx, md)
	return rec.resp, rec.err
}

// tellExpiry sends the caller expires, until when its key is honoured, if
// the store said. It goes in the trailer, as idempotent-replayed does, even
// of a reply: a header would make an error that an interceptor outside
// idemkey puts in the reply's place one that gRPC's retry policy does not
// retry. A first call's trailer is kept for the calls after it (trailers).
func (x *exchange) tellExpiry(expires time.Time, first bool) {
	if expires.IsZero() {
		return
	}
	kept := x.s.trailers.of(expires)
	switch {
	case kept == nil && first:
		kept = x.s.trailers.keep(expires)
	case kept == nil:
		_ = grpc.SetTrailer(x.ctx, metadata.MD{idemkey.ExpiresMetadata: x.expiry(expires)})
		return
	}
	_ = grpc.SetTrailer(x.ctx, kept.expiry)
}

// expiry is the value of the expiry's trailer, for a call alone: gRPC
// copies it.
func (x *exchange) expiry(expires time.Time) []string {
	x.expires[0] = idemkey.FormatDate(expires)
	return x.expires[:]
}

// allowed is the part of md whose keys are in keys; md itself if all are.
func allowed(md metadata.MD, keys map[string]bool) metadata.MD {
	for k := range md {
		if !keys[k] {
			out := make(metadata.MD, len(md))
			for k, vs := range md {
				if keys[k] {
					out[k] = vs
				}
			}
			return out
		}
	}
	return md
}
