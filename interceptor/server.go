package interceptor

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
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
	"github.com/idemkey/idemkey/store"
)

// UnaryServerInterceptor returns a server interceptor that runs each covered
// call at most once per idempotency key and replays its recorded outcome to
// every retry. See the package documentation for the request path.
//
// It panics if WithAtomic or WithAtomicMethods is given with a store that
// does not implement store.Atomic: a mistake to catch at start-up.
func UnaryServerInterceptor(st store.Store, opts ...Option) grpc.UnaryServerInterceptor {
	o := newOptions(opts)
	s := &server{store: st, opts: o, methods: &methods{opts: o}}
	s.atomic, _ = st.(store.Atomic)
	s.finder, _ = st.(store.Finder)
	if s.atomic == nil && (o.atomicAll || len(o.atomic) > 0) {
		panic(fmt.Sprintf("idemkey: atomic mode needs a store that implements store.Atomic, such as store/postgres; %T does not", st))
	}
	return s.intercept
}

type server struct {
	store   store.Store
	atomic  store.Atomic // st, if it implements store.Atomic
	finder  store.Finder // st, if it implements store.Finder
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
	c := call{method: m, key: store.NewKey(tenant, scopeMethod, key), parts: callParts{tenant, m.name, key}}
	fp, err := s.opts.fingerprint(m.name, msg)
	if err != nil {
		if _, isStatus := status.FromError(err); isStatus {
			return nil, err
		}
		s.log(ctx, slog.LevelError, "fingerprint failed", c, err)
		return nil, status.Error(codes.Internal, "idemkey: the request could not be fingerprinted")
	}
	if scopeMethod == "" {
		// A key shared across methods must never replay one method's reply
		// to another, whatever a custom fingerprint leaves out.
		fp = bindMethod(m.name, fp)
	}
	if s.finder != nil && retried(ctx) {
		res, found, err := s.finder.Find(ctx, c.key)
		if err == nil && found {
			return s.answer(ctx, c, fp, res)
		}
		// Failing closed, a store that cannot read cannot reserve either:
		// answer now rather than wait on it twice. Failing open, the
		// reservation is tried all the same before the handler runs bare.
		if err != nil && !s.failsOpen(m) {
			return nil, s.storeFailed(ctx, c, "find", err)
		}
	}
	r := store.Reservation{Key: c.key, Fingerprint: fp, Lease: s.lease(ctx), Retention: s.opts.retention}
	if m.atomic {
		return s.runAtomic(ctx, c, r, req, handler)
	}

	res, err := s.store.Reserve(ctx, r)
	if err != nil {
		if s.failsOpen(m) && ctx.Err() == nil {
			s.log(ctx, slog.LevelError, "reserve failed; the handler runs unprotected (WithFailOpen)", c, err)
			hctx, _ := s.handlerContext(ctx, c)
			return handler(hctx, req)
		}
		return nil, s.storeFailed(ctx, c, "reserve", err)
	}
	if res.State != store.Acquired {
		return s.answer(ctx, c, fp, res)
	}
	c.token = res.Token
	return s.run(ctx, c, req, handler)
}

// retried reports whether gRPC's retry policy marks the call as a later
// attempt (AttemptsMetadata above 0).
func retried(ctx context.Context) bool {
	attempts := metadata.ValueFromIncomingContext(ctx, idemkey.AttemptsMetadata)
	return len(attempts) > 0 && attempts[0] != "0"
}

// call is one covered call that found or holds its record.
type call struct {
	method *method
	key    store.Key
	parts  callParts
	token  store.Token
}

// callParts are what a call's key is derived from; the handler's context
// carries them for DerivedKey.
type callParts struct{ tenant, method, key string }

type callPartsKey struct{}

// partsContext is ctx carrying a call's parts: one allocation per call, where
// context.WithValue would take two (its context, and the parts boxed).
type partsContext struct {
	context.Context
	parts callParts
}

func (p *partsContext) Value(key any) any {
	if key == (callPartsKey{}) {
		return &p.parts
	}
	return p.Context.Value(key)
}

// DerivedKey returns the idempotency key for a call that the handler of ctx
// makes to another idempotent API, labelled by label: idemkey.DeriveKey of the
// call's tenant, method and key. Every retry of the call gets the same key,
// so the downstream API deduplicates it too. ok is false if ctx is not the
// handler context of a covered call with a key.
func DerivedKey(ctx context.Context, label string) (key string, ok bool) {
	p, ok := ctx.Value(callPartsKey{}).(*callParts)
	if !ok {
		return "", false
	}
	return idemkey.DeriveKey(p.tenant, p.method, p.key, label), true
}

// failsOpen reports whether a store failure runs m's handler unprotected:
// with WithFailOpen, except in atomic mode.
func (s *server) failsOpen(m *method) bool { return s.opts.failOpen && !m.atomic }

// storeFailed is the caller's answer when the store could not do op (find,
// reserve) before the handler.
func (s *server) storeFailed(ctx context.Context, c call, op string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	s.log(ctx, slog.LevelError, op+" failed", c, err)
	return idemkey.StoreUnavailableError()
}

// answer is the caller's answer when the key was not acquired: the replay of
// the recorded outcome, or the key is in progress, or reused.
func (s *server) answer(ctx context.Context, c call, fp store.Fingerprint, res store.Result) (any, error) {
	if res.Fingerprint != fp { // checked first, in either state
		return nil, idemkey.ReusedKeyError()
	}
	if res.State == store.Completed {
		return s.replay(ctx, c, res.Outcome)
	}
	// Only a trailer: a retry policy does not retry a reply with headers.
	wait := max(min(res.RetryAfter, s.opts.retryAfter), time.Millisecond)
	_ = grpc.SetTrailer(ctx, idemkey.PushbackTrailer(wait))
	return nil, idemkey.InProgressError(wait)
}

// handlerContext is ctx for the handler of c: it carries c's parts for
// DerivedKey and, if metadata is replayed, the recorder that keeps it.
func (s *server) handlerContext(ctx context.Context, c call) (context.Context, *recorder) {
	hctx, rec := context.Context(&partsContext{ctx, c.parts}), (*recorder)(nil)
	if len(s.opts.replayed) > 0 {
		if ts := grpc.ServerTransportStreamFromContext(ctx); ts != nil {
			rec = &recorder{ServerTransportStream: ts, allowed: s.opts.replayed}
			hctx = grpc.NewContextWithServerTransportStream(hctx, rec)
		}
	}
	return hctx, rec
}

// run runs the handler for an acquired key, then records or releases it.
func (s *server) run(ctx context.Context, c call, req any, handler grpc.UnaryHandler) (resp any, err error) {
	hctx, rec := s.handlerContext(ctx, c)
	returned := false
	defer func() {
		if !returned { // the handler panicked; let a retry run again
			s.release(ctx, c)
		}
	}()
	resp, err = handler(hctx, req)
	returned = true

	outcome, record, resp, err := s.settle(ctx, c, resp, err, rec)
	if record {
		s.complete(ctx, c, outcome)
	} else {
		s.release(ctx, c)
	}
	return resp, err
}

// settle decides what the store keeps of the handler's result, and what the
// caller gets: the handler's own result, unless it cannot be recorded. Then
// Internal is recorded instead, and the caller gets it too, like every retry.
// record is false when the key is to be released.
func (s *server) settle(ctx context.Context, c call, resp any, herr error, rec *recorder) (outcome []byte, record bool, _ any, _ error) {
	outcome, record, err := encodeOutcome(resp, herr, s.opts.recorded, rec)
	switch {
	case err != nil:
		s.log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead", c, err)
		return unrecordable, true, nil, unrecordableErr
	case record && len(outcome) > s.opts.maxRecord:
		s.log(ctx, slog.LevelError, "outcome cannot be recorded; Internal recorded instead", c,
			fmt.Errorf("its record of %d bytes exceeds the limit of %d (WithMaxRecordSize)", len(outcome), s.opts.maxRecord))
		return tooLarge, true, nil, tooLargeErr
	}
	return outcome, record, resp, herr
}

// runAtomic reserves the key in a transaction, runs the handler in it, and
// commits the handler's writes with the record, or rolls everything back.
// The caller gets the handler's result only if it committed.
func (s *server) runAtomic(ctx context.Context, c call, r store.Reservation, req any, handler grpc.UnaryHandler) (resp any, err error) {
	res, tx, err := s.atomic.Begin(ctx, r)
	if err != nil {
		return nil, s.storeFailed(ctx, c, "reserve", err)
	}
	if res.State != store.Acquired {
		return s.answer(ctx, c, r.Fingerprint, res)
	}
	hctx, rec := s.handlerContext(ctx, c)
	ended := false
	defer func() {
		if !ended { // the handler, or settling its result, panicked: roll back, so that a retry runs again
			s.rollback(ctx, c, tx)
		}
	}()
	resp, err = handler(tx.HandlerContext(hctx), req)
	outcome, record, resp, err := s.settle(ctx, c, resp, err, rec)
	ended = true
	if !record {
		s.rollback(ctx, c, tx)
		return resp, err
	}
	// Only a success keeps the handler's writes: a recorded error, or a reply
	// that could not be recorded, undoes them.
	if commitErr := tx.Commit(ctx, outcome, err == nil); commitErr != nil {
		s.log(ctx, slog.LevelError, "commit failed; the call's writes and record were rolled back, or their fate is unknown, and a retry finds out", c, commitErr)
		return nil, idemkey.StoreUnavailableError()
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

func (s *server) rollback(ctx context.Context, c call, tx store.Tx) {
	if err := tx.Rollback(ctx); err != nil {
		s.log(ctx, slog.LevelWarn, "rollback failed; the database rolls back when it closes the connection", c, err)
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

// bindMethod hashes a fingerprint together with the method it was made for.
func bindMethod(fullMethod string, fp store.Fingerprint) store.Fingerprint {
	return sha256.Sum256(append(appendPart(make([]byte, 0, 256), fullMethod), fp[:]...))
}

// appendPart appends s with its length in front, so that no two sequences of
// parts hash alike.
func appendPart(b []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint64(b, uint64(len(s))), s...)
}
