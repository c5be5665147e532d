package interceptor

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// UnaryServerInterceptor returns a server interceptor that runs each covered
// call at most once per idempotency key on eng, and replays its recorded
// outcome to every retry; opts are the gRPC adapter's own settings.
//
// It returns an error for a mistake to catch at start-up: a nil eng, no
// tenant (engine.WithTenant), atomic mode on a store that is not a
// store.Atomic, or a method the protobuf registry does not know.
func UnaryServerInterceptor(eng *engine.Engine, opts ...Option) (grpc.UnaryServerInterceptor, error) {
	o := newOptions(opts)
	if err := rpckit.Check(o.Coverage, naming, true, eng); err != nil {
		return nil, err
	}
	s := &server{eng: eng, opts: o, methods: rpckit.NewMethods(o.Coverage, eng, "grpc")}
	return s.intercept, nil
}

// server translates gRPC calls into the engine's request path and back.
type server struct {
	eng      *engine.Engine
	opts     *options
	methods  *rpckit.Methods
	trailers trailers
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := s.methods.Get(info.FullMethod, nil, false)
	if !m.Covered {
		if len(metadata.ValueFromIncomingContext(ctx, idemkey.KeyMetadata)) > 0 {
			_ = grpc.SetTrailer(ctx, ignoredTrailer) // a trailer, as the replay marker
		}
		return handler(ctx, req)
	}
	x := &exchange{s: s, ctx: ctx, req: req, m: m, handler: handler}
	s.eng.Serve(ctx, m.Op, x)
	return x.resp, x.err
}

// exchange is one covered call, as engine.Serve reads and answers it.
type exchange struct {
	s       *server
	ctx     context.Context
	req     any
	m       *rpckit.Method
	handler grpc.UnaryHandler
	rec     *recorder // the metadata the handler set, when some is replayed
	keyed   bool      // Key found one: Pass runs it unprotected (FailedOpen)
	expires [1]string // the value of the expiry's trailer (expiry)
	resp    any
	err     error
}

func (x *exchange) Key() (string, bool, error) {
	key, ok, err := x.s.key(x.ctx, x.req, x.m)
	x.keyed = ok
	return key, ok, err
}

func (x *exchange) FirstSent() []string {
	return metadata.ValueFromIncomingContext(x.ctx, idemkey.FirstSentMetadata)
}

func (x *exchange) FirstRegion() []string {
	return metadata.ValueFromIncomingContext(x.ctx, idemkey.FirstRegionMetadata)
}
func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{Retried: retried(x.ctx)} }

func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	fp, st, err := x.m.Fingerprint(ctx, x.s.eng.Logger(), x.req, x.s.opts.Fingerprint, isStatus)
	if st != nil {
		return fp, toError(st)
	}
	return fp, err
}

func isStatus(err error) bool {
	_, ok := status.FromError(err)
	return ok
}

func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	ctx = x.handlerContext(ctx)
	x.resp, x.err = x.handler(ctx, x.req)
	raw, record, err := x.encode()
	return engine.HandlerResult{Record: raw, Release: !record && err == nil, KeepWrites: x.err == nil, Unrecordable: err}
}

func (x *exchange) StandIn(why error) []byte {
	raw, _ := rpckit.StandIn(why)
	return raw
}

func (x *exchange) Pass(ctx context.Context) int {
	if x.keyed {
		_ = grpc.SetTrailer(x.ctx, ignoredTrailer)
	}
	x.resp, x.err = x.handler(x.handlerContext(ctx), x.req)
	return int(status.Code(x.err))
}

func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	x.resp, x.err = x.answer(a)
	return int(status.Code(x.err))
}

func (x *exchange) answer(a engine.Answer) (any, error) {
	switch a.Verdict {
	case engine.Executed:
		x.tellExpiry(a.Expires, true)
		if a.StandIn != nil {
			_, st := rpckit.StandIn(a.StandIn)
			return nil, toError(st)
		}
		return x.resp, x.err
	case engine.Replayed:
		return x.replay(a)
	case engine.KeyInvalid, engine.Refused:
		return nil, a.Err // the key's, the tenant's or the fingerprint's, already a status
	case engine.InProgress:
		// Only a trailer: a retry policy does not retry a reply with headers.
		_ = grpc.SetTrailer(x.ctx, pushbackTrailer(a.RetryAfter))
		x.tellExpiry(a.Expires, false)
	case engine.Reused:
		x.tellExpiry(a.Expires, false)
	}
	return nil, toError(rpckit.Refusal(x.ctx, a, missingKeyAdvice(x.ctx)))
}

func (s *server) key(ctx context.Context, req any, m *rpckit.Method) (string, bool, error) {
	key, ok, err := KeyFromIncomingContext(ctx)
	if err != nil {
		return key, ok, err
	}
	key, ok, err = m.Key(key, ok, req)
	if err != nil {
		return "", false, toError(rpckit.InvalidKey(err))
	}
	return key, ok, nil
}

func retried(ctx context.Context) bool {
	attempts := metadata.ValueFromIncomingContext(ctx, AttemptsMetadata)
	return len(attempts) > 0 && attempts[0] != "0"
}

func (x *exchange) handlerContext(ctx context.Context) context.Context {
	if len(x.s.opts.Replayed) > 0 {
		if ts := grpc.ServerTransportStreamFromContext(ctx); ts != nil {
			x.rec = &recorder{ServerTransportStream: ts, allowed: x.s.opts.Replayed}
			ctx = grpc.NewContextWithServerTransportStream(ctx, x.rec)
		}
	}
	return ctx
}

func (x *exchange) replay(a engine.Answer) (any, error) {
	ctx, s := x.ctx, x.s
	rec, st := x.m.Read(ctx, s.eng.Logger(), a.Outcome)
	if st != nil {
		return nil, toError(st)
	}
	if md := toMD(rpckit.Allowed(rec.Header, s.opts.Replayed)); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	if md := toMD(rpckit.Allowed(rec.Trailer, s.opts.Replayed)); len(md) > 0 {
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
	if rec.Status != nil {
		return nil, toError(rec.Status)
	}
	return rec.Response, nil
}

// tellExpiry sends the expiry, and for a first execution its marker, in the
// trailer even of a reply: a header would stop gRPC's retry policy from
// retrying an error an outer interceptor puts in the reply's place.
func (x *exchange) tellExpiry(expires time.Time, first bool) {
	if expires.IsZero() {
		if first {
			_ = grpc.SetTrailer(x.ctx, firstTrailer)
		}
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
	md := kept.expiry
	if first {
		md = kept.first
	}
	_ = grpc.SetTrailer(x.ctx, md)
}

// expiry is the expiry's trailer value, for this call alone (gRPC copies it).
func (x *exchange) expiry(expires time.Time) []string {
	x.expires[0] = idemkey.FormatDate(expires)
	return x.expires[:]
}
