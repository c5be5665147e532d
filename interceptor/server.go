package interceptor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

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
// call at most once per idempotency key and replays its recorded outcome to
// every retry. See the package documentation for the request path.
//
// It returns an error for a mistake to catch at start-up: WithAtomic or
// WithAtomicMethods with a store that does not implement store.Atomic, or a
// method named in WithIncludedMethods, WithExcludedMethods or
// WithAtomicMethods that the protobuf registry does not know (or, for
// WithAtomicMethods, that is not covered).
func UnaryServerInterceptor(st store.Store, opts ...Option) (grpc.UnaryServerInterceptor, error) {
	o := newOptions(opts)
	if err := checkMethods(o); err != nil {
		return nil, err
	}
	if _, ok := st.(store.Atomic); !ok && (o.atomicAll || len(o.atomic) > 0) {
		return nil, fmt.Errorf("idemkey: atomic mode needs a store that implements store.Atomic, such as store/postgres; %T does not", st)
	}
	eng := engine.New(st, o.engine...)
	s := &server{eng: eng, opts: o, methods: &methods{opts: o, eng: eng}}
	return s.intercept, nil
}

// server translates gRPC calls into the engine's request path and back:
// where the key comes from (metadata), how the request is fingerprinted
// (protokey.HashRequest), and how an outcome is recorded (outcome.go) and replayed.
type server struct {
	eng     *engine.Engine
	opts    *options
	methods *methods
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := s.methods.get(info.FullMethod)
	if !m.covered {
		return handler(ctx, req)
	}
	c := s.eng.Call(m.op)
	resp, err := s.serve(ctx, req, m, handler, &c)
	code := codes.OK
	if err != nil {
		code = status.Code(err)
	}
	c.End(ctx, int(code))
	return resp, err
}

// serve is intercept for a covered method; it sets c.Verdict to what became
// of the call.
func (s *server) serve(ctx context.Context, req any, m *method, handler grpc.UnaryHandler, c *engine.Call) (any, error) {
	key, ok, err := s.key(ctx, req, m)
	if err != nil {
		c.Verdict = engine.KeyInvalid
		return nil, err
	}
	if !ok {
		if s.eng.KeyRequired() {
			c.Verdict = engine.KeyMissing
			return nil, MissingKeyError()
		}
		c.Verdict = engine.NoKey
		return handler(ctx, req)
	}
	firstSent, err := s.eng.FirstSent(metadata.ValueFromIncomingContext(ctx, idemkey.FirstSentMetadata))
	if err != nil {
		c.Verdict = engine.FirstSentInvalid
		return nil, firstSentError(err)
	}
	if m.output == nil {
		return nil, status.Error(codes.Internal, "idemkey: the method is not in the protobuf registry, so its replies cannot be replayed")
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, status.Error(codes.Internal, "idemkey: the request is not a protobuf message")
	}
	tenant, err := s.eng.Tenant(ctx)
	if err != nil {
		return nil, err
	}
	var fp store.Fingerprint
	if s.opts.fingerprint == nil {
		fp, err = protokey.HashRequestWithout(m.name, msg, m.keyField)
	} else {
		fp, err = s.opts.fingerprint(m.name, msg)
	}
	if err != nil {
		if _, isStatus := status.FromError(err); isStatus {
			return nil, err
		}
		c.Log(ctx, slog.LevelError, "fingerprint failed", err)
		return nil, status.Error(codes.Internal, "idemkey: the request could not be fingerprinted")
	}

	c.Start(ctx, engine.Request{Tenant: tenant, Key: key, Fingerprint: fp, Retried: retried(ctx), FirstSent: firstSent})
	switch c.Verdict {
	case engine.Executed:
		return s.run(ctx, c, m, req, handler)
	case engine.FailedOpen:
		hctx, _ := s.handlerContext(ctx, c)
		return handler(hctx, req)
	}
	return s.answer(ctx, c, m)
}

// answer answers a call that did not run the handler, as c.Verdict says.
func (s *server) answer(ctx context.Context, c *engine.Call, m *method) (any, error) {
	switch c.Verdict {
	case engine.Replayed:
		return s.replay(ctx, c, m)
	case engine.InProgress:
		// Only a trailer: a retry policy does not retry a reply with headers.
		_ = grpc.SetTrailer(ctx, PushbackTrailer(c.RetryAfter))
		tellExpiry(ctx, c)
		return nil, InProgressError(c.RetryAfter)
	case engine.Reused:
		tellExpiry(ctx, c)
		return nil, ReusedKeyError()
	case engine.Expired:
		return nil, KeyExpiredError()
	case engine.FirstSentInvalid:
		return nil, FirstSentInvalidError(futureFirstSent)
	case engine.StoreFull:
		return nil, StoreFullError(c.RetryAfter)
	}
	if ctx.Err() != nil {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	return nil, StoreUnavailableError()
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
		return "", false, InvalidKeyError(err.(*idemkey.KeyError).Problem)
	}
	return key, ok, nil
}

// retried reports whether gRPC's retry policy marks the call as a later
// attempt (AttemptsMetadata above 0).
func retried(ctx context.Context) bool {
	attempts := metadata.ValueFromIncomingContext(ctx, AttemptsMetadata)
	return len(attempts) > 0 && attempts[0] != "0"
}

// handlerContext is ctx for the handler of c: the engine's (DerivedKey, the
// transaction in atomic mode) and, if metadata is replayed, with the recorder
// that keeps it.
func (s *server) handlerContext(ctx context.Context, c *engine.Call) (context.Context, *recorder) {
	hctx, rec := c.Context(ctx), (*recorder)(nil)
	if len(s.opts.replayed) > 0 {
		if ts := grpc.ServerTransportStreamFromContext(ctx); ts != nil {
			rec = &recorder{ServerTransportStream: ts, allowed: s.opts.replayed}
			hctx = grpc.NewContextWithServerTransportStream(hctx, rec)
		}
	}
	return hctx, rec
}

// run runs the handler for an acquired key, then records its outcome or
// releases the key. In atomic mode only a success keeps the handler's
// writes: a recorded error, or a reply that could not be recorded, undoes
// them.
func (s *server) run(ctx context.Context, c *engine.Call, m *method, req any, handler grpc.UnaryHandler) (any, error) {
	hctx, rec := s.handlerContext(ctx, c)
	defer c.Abandon(ctx) // the handler panicked: let a retry run again
	resp, err := handler(hctx, req)

	outcome, record, encodeErr := encodeOutcome(ctx, m.name, resp, err, s.opts.recorded, rec, s.opts.redact)
	if encodeErr != nil {
		c.Log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead", encodeErr)
		return s.recordInstead(ctx, c, m, unrecordable, unrecordableErr)
	}
	if !record {
		c.Release(ctx)
		return resp, err
	}
	switch recErr := c.Record(ctx, outcome, err == nil); {
	case errors.Is(recErr, engine.ErrTooLarge):
		return s.recordInstead(ctx, c, m, tooLarge, tooLargeErr)
	case errors.Is(recErr, store.ErrFull):
		return s.recordInstead(ctx, c, m, noRoom, noRoomErr)
	case errors.Is(recErr, engine.ErrSuperseded):
		return s.answer(ctx, c, m)
	case recErr != nil:
		return nil, StoreUnavailableError()
	}
	tellExpiry(ctx, c)
	return resp, err
}

// recordInstead records a short Internal in place of a reply that cannot be
// recorded: the handler has run, so its key must not be released. The caller
// gets it too, as every retry will; if even it cannot be recorded, the key
// stays in progress until its lease ends. Only in atomic mode, where a
// failed commit undoes the handler's writes, is the answer Unavailable.
func (s *server) recordInstead(ctx context.Context, c *engine.Call, m *method, outcome []byte, err error) (any, error) {
	switch recErr := c.Record(ctx, outcome, false); {
	case errors.Is(recErr, engine.ErrSuperseded):
		return s.answer(ctx, c, m)
	case recErr != nil && c.Atomic():
		return nil, StoreUnavailableError()
	case recErr == nil:
		tellExpiry(ctx, c)
	}
	return nil, err
}

// replay answers a retry with the recorded outcome.
func (s *server) replay(ctx context.Context, c *engine.Call, m *method) (any, error) {
	rec, err := decodeOutcome(c.Outcome, m.output)
	if err != nil {
		c.Log(ctx, slog.LevelError, "recorded outcome is corrupt", err)
		return nil, status.Error(codes.Internal, "idemkey: the recorded outcome of this call cannot be read")
	}
	// The allow-list of today applies, not the one the record was made under.
	if md := allowed(rec.header, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	if md := allowed(rec.trailer, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetTrailer(ctx, md)
	}
	_ = grpc.SetTrailer(ctx, replayedTrailer) // gRPC copies it; it is never modified
	tellExpiry(ctx, c)
	return rec.resp, rec.err
}

// tellExpiry sends the caller c.Expires, until when its key is honoured, if
// the store said. It goes in the trailer, as idempotent-replayed does, even
// of a reply: a header would make an error that an interceptor outside
// idemkey puts in the reply's place one that gRPC's retry policy does not
// retry.
func tellExpiry(ctx context.Context, c *engine.Call) {
	if !c.Expires.IsZero() {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(idemkey.ExpiresMetadata, idemkey.FormatDate(c.Expires)))
	}
}

var replayedTrailer = metadata.Pairs(idemkey.ReplayedMetadata, "true")

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
