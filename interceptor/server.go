package interceptor

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// UnaryServerInterceptor returns a server interceptor that runs each covered
// call at most once per idempotency key and replays its recorded outcome to
// every retry. See the package documentation for the request path.
func UnaryServerInterceptor(st store.Store, opts ...Option) grpc.UnaryServerInterceptor {
	o := newOptions(opts)
	s := &server{store: st, opts: o, methods: &methods{opts: o}}
	return s.intercept
}

type server struct {
	store   store.Store
	opts    *options
	methods *methods
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := s.methods.get(info.FullMethod)
	if !m.covered {
		return handler(ctx, req)
	}
	key, ok, err := idemkey.KeyFromIncomingContext(ctx)
	if err != nil {
		return nil, err
	}
	if !ok {
		if s.opts.keyRequired {
			return nil, idemkey.MissingKeyError()
		}
		return handler(ctx, req)
	}
	if m.output == nil {
		return nil, status.Error(codes.Internal, "idemkey: the method is not in the protobuf registry, so its replies cannot be replayed")
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, status.Error(codes.Internal, "idemkey: the request is not a protobuf message")
	}

	var tenant string
	if s.opts.tenant != nil {
		if tenant, err = s.opts.tenant(ctx); err != nil {
			return nil, err
		}
	}
	scopeMethod := m.name
	if s.opts.scope == ScopeTenant {
		scopeMethod = ""
	}
	call := call{method: m, key: store.NewKey(tenant, scopeMethod, key)}
	fp, err := s.opts.fingerprint(m.name, msg)
	if err != nil {
		if _, isStatus := status.FromError(err); isStatus {
			return nil, err
		}
		s.log(ctx, slog.LevelError, "fingerprint failed", call, err)
		return nil, status.Error(codes.Internal, "idemkey: the request could not be fingerprinted")
	}
	if scopeMethod == "" {
		// A key shared across methods must never replay one method's reply
		// to another, whatever a custom fingerprint leaves out.
		fp = bindMethod(m.name, fp)
	}

	res, err := s.store.Reserve(ctx, store.Reservation{
		Key:         call.key,
		Fingerprint: fp,
		Lease:       s.lease(ctx),
		Retention:   s.opts.retention,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		s.log(ctx, slog.LevelError, "reserve failed", call, err)
		if s.opts.failOpen {
			return handler(ctx, req)
		}
		return nil, idemkey.StoreUnavailableError()
	}
	switch res.State {
	case store.Completed:
		if res.Fingerprint != fp {
			return nil, idemkey.ReusedKeyError()
		}
		return s.replay(ctx, call, res.Outcome)
	case store.InProgress:
		if res.Fingerprint != fp {
			return nil, idemkey.ReusedKeyError()
		}
		// Only a trailer: a retry policy does not retry a reply with headers.
		wait := max(min(res.RetryAfter, s.opts.retryAfter), time.Millisecond)
		_ = grpc.SetTrailer(ctx, idemkey.PushbackTrailer(wait))
		return nil, idemkey.InProgressError(wait)
	}
	call.token = res.Token
	return s.run(ctx, call, req, handler)
}

// call is one covered call that found or holds its record.
type call struct {
	method *method
	key    store.Key
	token  store.Token
}

// run runs the handler for an acquired key, then records or releases it.
func (s *server) run(ctx context.Context, c call, req any, handler grpc.UnaryHandler) (resp any, err error) {
	hctx, rec := ctx, (*recorder)(nil)
	if len(s.opts.replayed) > 0 {
		if ts := grpc.ServerTransportStreamFromContext(ctx); ts != nil {
			rec = &recorder{ServerTransportStream: ts, allowed: s.opts.replayed}
			hctx = grpc.NewContextWithServerTransportStream(ctx, rec)
		}
	}
	returned := false
	defer func() {
		if !returned { // the handler panicked; let a retry run again
			s.release(ctx, c)
		}
	}()
	resp, err = handler(hctx, req)
	returned = true

	outcome, record, encodeErr := encodeOutcome(resp, err, s.opts.recorded, rec)
	switch {
	case encodeErr != nil:
		s.log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead", c, encodeErr)
		s.complete(ctx, c, unrecordable)
	case record:
		s.complete(ctx, c, outcome)
	default:
		s.release(ctx, c)
	}
	return resp, err
}

// replay answers a retry with the recorded outcome.
func (s *server) replay(ctx context.Context, c call, raw []byte) (any, error) {
	rec, err := decodeOutcome(raw, c.method.output)
	if err != nil {
		s.log(ctx, slog.LevelError, "recorded outcome is corrupt", c, err)
		return nil, status.Error(codes.Internal, "idemkey: the recorded outcome of this call cannot be read")
	}
	if len(rec.header) > 0 {
		_ = grpc.SetHeader(ctx, rec.header)
	}
	if len(rec.trailer) > 0 {
		_ = grpc.SetTrailer(ctx, rec.trailer)
	}
	_ = grpc.SetTrailer(ctx, replayedTrailer) // gRPC copies it; it is never modified
	return rec.resp, rec.err
}

var replayedTrailer = metadata.Pairs(idemkey.ReplayedMetadata, "true")

// complete records the outcome. Like release, it detaches the store write
// from the caller's cancellation: a client that hangs up must not leave its
// key in progress. The store bounds the write's time (see store.Store).
func (s *server) complete(ctx context.Context, c call, outcome []byte) {
	ctx = context.WithoutCancel(ctx)
	if err := s.store.Complete(ctx, c.key, c.token, outcome); err != nil {
		s.logWriteFailure(ctx, "complete", c, err)
	}
}

func (s *server) release(ctx context.Context, c call) {
	ctx = context.WithoutCancel(ctx)
	if err := s.store.Release(ctx, c.key, c.token); err != nil {
		s.logWriteFailure(ctx, "release", c, err)
	}
}

func (s *server) logWriteFailure(ctx context.Context, op string, c call, err error) {
	if errors.Is(err, store.ErrLeaseLost) {
		s.log(ctx, slog.LevelWarn, op+" refused: the lease was taken over, so another run of the handler may have happened", c, err)
		return
	}
	s.log(ctx, slog.LevelError, op+" failed; the key stays in progress until its lease ends", c, err)
}

func (s *server) log(ctx context.Context, level slog.Level, msg string, c call, err error) {
	s.opts.logger.LogAttrs(ctx, level, "idemkey: "+msg,
		slog.String("method", c.method.name),
		slog.String("scope", c.key.String()),
		slog.Any("error", err))
}

// lease is the call's remaining deadline plus a grace period, at most the
// maximum lease; a call without a deadline gets the default lease.
func (s *server) lease(ctx context.Context) time.Duration {
	deadline, ok := ctx.Deadline()
	if !ok {
		return s.opts.lease
	}
	return min(max(time.Until(deadline), 0)+leaseGrace, s.opts.maxLease)
}

// Fingerprint is the default FingerprintFunc: the SHA-256 of the full method
// name and the request marshalled deterministically. Deterministic marshalling
// is stable for one schema and one protobuf-go version; a retry that crosses a
// change of either may be refused as a reused key.
func Fingerprint(fullMethod string, req proto.Message) (store.Fingerprint, error) {
	buf := fingerprintBuffers.Get().(*[]byte)
	defer fingerprintBuffers.Put(buf)
	b, err := proto.MarshalOptions{Deterministic: true}.MarshalAppend(appendPart((*buf)[:0], fullMethod), req)
	if err != nil {
		return store.Fingerprint{}, err
	}
	if cap(b) <= 64<<10 { // keep small buffers only
		*buf = b
	}
	return sha256.Sum256(b), nil
}

var fingerprintBuffers = sync.Pool{New: func() any { return new([]byte) }}

// bindMethod hashes a fingerprint together with the method it was made for.
func bindMethod(fullMethod string, fp store.Fingerprint) store.Fingerprint {
	return sha256.Sum256(append(appendPart(make([]byte, 0, 256), fullMethod), fp[:]...))
}

// appendPart appends s with its length in front, so that no two sequences of
// parts hash alike.
func appendPart(b []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint64(b, uint64(len(s))), s...)
}
