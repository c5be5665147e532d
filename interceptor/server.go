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
// It panics on mistakes to catch at start-up: WithAtomic or WithAtomicMethods
// with a store that does not implement store.Atomic, or a method named in
// WithIncludedMethods, WithExcludedMethods or WithAtomicMethods that the
// protobuf registry does not know (or, for WithAtomicMethods, that is not
// covered).
func UnaryServerInterceptor(st store.Store, opts ...Option) grpc.UnaryServerInterceptor {
	o := newOptions(opts)
	if err := checkMethods(o); err != nil {
		panic(err.Error())
	}
	s := &server{store: st, opts: o, methods: &methods{opts: o}, obs: newObserver(o)}
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
	obs     *observer
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	m := s.methods.get(info.FullMethod)
	if !m.covered {
		return handler(ctx, req)
	}
	start := time.Now()
	var c call
	o := verdictExecuted
	resp, err := s.serve(ctx, req, m, handler, &c, &o)
	s.obs.callEnded(ctx, m, &c, o, err, start)
	return resp, err
}

// serve is intercept for a covered method. It fills in c once the call's key
// is known, and o with what became of the call.
func (s *server) serve(ctx context.Context, req any, m *method, handler grpc.UnaryHandler, cp *call, o *verdict) (any, error) {
	key, ok, err := idemkey.KeyFromIncomingContext(ctx)
	if err != nil {
		*o = verdictKeyInvalid
		return nil, err
	}
	if !ok {
		if s.opts.keyRequired {
			*o = verdictKeyMissing
			return nil, idemkey.MissingKeyError()
		}
		*o = verdictNoKey
		return handler(ctx, req)
	}
	*o = verdictRefused
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
	*cp = call{method: m, key: store.NewKey(tenant, scopeMethod, key), parts: callParts{tenant, m.name, key}}
	c := cp
	fp, err := s.opts.fingerprint(m.name, msg)
	if err != nil {
		if _, isStatus := status.FromError(err); isStatus {
			return nil, err
		}
		s.log(ctx, slog.LevelError, "fingerprint failed", *c, err)
		return nil, status.Error(codes.Internal, "idemkey: the request could not be fingerprinted")
	}
	if scopeMethod == "" {
		// A key shared across methods must never replay one method's reply
		// to another, whatever a custom fingerprint leaves out.
		fp = bindMethod(m.name, fp)
	}
	if s.finder != nil && retried(ctx) {
		res, found, err := s.find(ctx, c.key)
		if err == nil && found {
			return s.answer(ctx, *c, fp, res, o)
		}
		// Failing closed, a store that cannot read cannot reserve either:
		// answer now rather than wait on it twice. Failing open, the
		// reservation is tried all the same before the handler runs bare.
		if err != nil && !s.failsOpen(m) {
			*o = verdictStoreUnavailable
			return nil, s.storeFailed(ctx, *c, "find", err)
		}
	}
	r := store.Reservation{Key: c.key, Fingerprint: fp, Lease: s.lease(ctx), Retention: s.opts.retention}
	c.leaseEnd = time.Now().Add(r.Lease) // the store's clock starts it later, never earlier
	if m.atomic {
		return s.runAtomic(ctx, *c, r, req, handler, o)
	}

	res, err := s.reserve(ctx, r)
	if err == nil && res.State == store.InProgress && res.Fingerprint == fp {
		res, err = s.await(ctx, res, func(ctx context.Context) (store.Result, error) { return s.reserve(ctx, r) })
	}
	if errors.Is(err, store.ErrFull) {
		*o = verdictStoreFull
		s.log(ctx, slog.LevelWarn, "reserve refused: the store is full", *c, err)
		return nil, idemkey.StoreFullError(s.opts.retryAfter)
	}
	if err != nil {
		if s.failsOpen(m) && ctx.Err() == nil {
			*o = verdictFailedOpen
			s.log(ctx, slog.LevelError, "reserve failed; the handler runs unprotected (WithFailOpen)", *c, err)
			hctx, _ := s.handlerContext(ctx, *c)
			return handler(hctx, req)
		}
		*o = verdictStoreUnavailable
		return nil, s.storeFailed(ctx, *c, "reserve", err)
	}
	if res.State != store.Acquired {
		return s.answer(ctx, *c, fp, res, o)
	}
	c.token = res.Token
	*o = verdictExecuted
	return s.run(ctx, *c, req, handler)
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
	// leaseEnd is when, at the earliest, the store ends the lease of the
	// reservation.
	leaseEnd time.Time
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
func (s *server) answer(ctx context.Context, c call, fp store.Fingerprint, res store.Result, o *verdict) (any, error) {
	if res.Fingerprint != fp { // checked first, in either state
		*o = verdictReused
		return nil, idemkey.ReusedKeyError()
	}
	if res.State == store.Completed {
		*o = verdictReplayed
		return s.replay(ctx, c, res.Outcome)
	}
	*o = verdictInProgress
	// Only a trailer: a retry policy does not retry a reply with headers.
	wait := max(min(res.RetryAfter, s.opts.retryAfter), time.Millisecond)
	_ = grpc.SetTrailer(ctx, idemkey.PushbackTrailer(wait))
	return nil, idemkey.InProgressError(wait)
}

// Polls of a key in progress: the first after awaitFirstPoll, each next one
// twice as late, at most awaitMaxPoll apart. A duplicate leaves awaitMargin of
// its deadline for its answer to reach the client.
const (
	awaitFirstPoll = 25 * time.Millisecond
	awaitMaxPoll   = 500 * time.Millisecond
	awaitMargin    = 50 * time.Millisecond
)

// await waits for a key that res found in progress to be recorded (or
// released), polling the store with poll, for at most WithInProgressWait and
// the call's deadline. It returns the first result that is not InProgress, or
// the last one when the wait runs out. A wait of w costs at most
// 5 + w/awaitMaxPoll polls.
func (s *server) await(ctx context.Context, res store.Result, poll func(context.Context) (store.Result, error)) (store.Result, error) {
	wait := s.opts.inProgress
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, max(time.Until(deadline), 0)-awaitMargin)
	}
	if wait < awaitFirstPoll {
		return res, nil
	}
	end := time.Now().Add(wait)
	timer := time.NewTimer(awaitFirstPoll)
	defer timer.Stop()
	for interval := awaitFirstPoll; ; interval = min(2*interval, awaitMaxPoll) {
		select {
		case <-ctx.Done():
			return res, nil
		case <-timer.C:
		}
		next, err := poll(ctx)
		if err != nil || next.State != store.InProgress {
			return next, err
		}
		res = next
		left := time.Until(end)
		if left <= 0 {
			return res, nil
		}
		timer.Reset(min(2*interval, awaitMaxPoll, left))
	}
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
	if !record {
		s.release(ctx, c)
		return resp, err
	}
	s.obs.recorded(ctx, c.method, len(outcome))
	if errors.Is(s.complete(ctx, c, outcome), store.ErrFull) {
		// The handler has run, so its key must not be released: a short
		// error takes the reply's place, for the caller and every retry.
		s.complete(ctx, c, noRoom)
		return nil, noRoomErr
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
func (s *server) runAtomic(ctx context.Context, c call, r store.Reservation, req any, handler grpc.UnaryHandler, o *verdict) (resp any, err error) {
	res, tx, err := s.begin(ctx, r)
	if err == nil && res.State == store.InProgress && res.Fingerprint == r.Fingerprint && s.finder != nil {
		// Polled with reads: a transaction per poll would hold a connection
		// for each waiting duplicate. A first call that rolls back is not
		// seen; the duplicate's retry acquires the key.
		res, err = s.await(ctx, res, func(ctx context.Context) (store.Result, error) {
			found, ok, err := s.find(ctx, c.key)
			if !ok {
				return res, err
			}
			return found, nil
		})
	}
	if err != nil {
		*o = verdictStoreUnavailable
		return nil, s.storeFailed(ctx, c, "reserve", err)
	}
	if res.State != store.Acquired {
		return s.answer(ctx, c, r.Fingerprint, res, o)
	}
	*o = verdictExecuted
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
	s.obs.recorded(ctx, c.method, len(outcome))
	if commitErr := s.commit(ctx, tx, outcome, err == nil); commitErr != nil {
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
	// The allow-list of today applies, not the one the record was made under.
	if md := allowed(rec.header, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetHeader(ctx, md)
	}
	if md := allowed(rec.trailer, s.opts.replayed); len(md) > 0 {
		_ = grpc.SetTrailer(ctx, md)
	}
	_ = grpc.SetTrailer(ctx, replayedTrailer) // gRPC copies it; it is never modified
	return rec.resp, rec.err
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

// complete records the outcome. Like release, it detaches the store write
// from the caller's cancellation: a client that hangs up must not leave its
// key in progress. The store bounds the write's time (see store.Store).
//
// A record that fails for a reason other than a lost lease or a full store
// is tried again in the background (completeLater): were it lost, a retry
// after the lease would run the handler a second time.
func (s *server) complete(ctx context.Context, c call, outcome []byte) error {
	err := s.storeComplete(ctx, c, outcome)
	if err == nil {
		return nil
	}
	ctx = context.WithoutCancel(ctx) // for the log, and the goroutine
	switch {
	case errors.Is(err, store.ErrLeaseLost), errors.Is(err, store.ErrFull):
		s.logWriteFailure(ctx, "complete", c, err)
	default:
		s.log(ctx, slog.LevelError, "complete failed; it is tried again in the background until shortly before the lease ends", c, err)
		go s.completeLater(ctx, c, outcome)
	}
	return err
}

// Pauses between the background attempts of completeLater.
const (
	laterFirstPause = 100 * time.Millisecond
	laterMaxPause   = 5 * time.Second
)

// completeLater tries to record outcome until shortly before the lease of c
// ends (a quarter of it before, at most a second), and logs how that ended.
// Past that point a retry may take the key over, and the record would be
// refused anyway.
func (s *server) completeLater(ctx context.Context, c call, outcome []byte) {
	until := c.leaseEnd.Add(-min(max(time.Until(c.leaseEnd), 0)/4, time.Second))
	err := errors.New("no time was left before the lease ends")
	for attempt, pause := 2, laterFirstPause; time.Until(until) > pause; attempt, pause = attempt+1, min(2*pause, laterMaxPause) {
		time.Sleep(pause)
		wctx, cancel := context.WithDeadline(ctx, until)
		err = s.storeComplete(wctx, c, outcome)
		cancel()
		switch {
		case err == nil:
			s.opts.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey: complete succeeded in the background",
				slog.String("method", c.method.name), slog.String("scope", c.key.String()), slog.Int("attempt", attempt))
			return
		case errors.Is(err, store.ErrLeaseLost), errors.Is(err, store.ErrFull):
			s.logWriteFailure(ctx, "complete", c, err)
			return
		}
	}
	s.log(ctx, slog.LevelError, "complete failed until shortly before the lease ends; a retry after it runs the handler again", c, err)
}

func (s *server) release(ctx context.Context, c call) {
	if err := s.storeRelease(ctx, c); err != nil {
		s.logWriteFailure(context.WithoutCancel(ctx), "release", c, err)
	}
}

func (s *server) rollback(ctx context.Context, c call, tx store.Tx) {
	if err := tx.Rollback(ctx); err != nil {
		s.log(ctx, slog.LevelWarn, "rollback failed; the database rolls back when it closes the connection", c, err)
	}
}

func (s *server) logWriteFailure(ctx context.Context, op string, c call, err error) {
	switch {
	case errors.Is(err, store.ErrLeaseLost):
		s.log(ctx, slog.LevelWarn, op+" refused: the lease was taken over, so another run of the handler may have happened", c, err)
		return
	case errors.Is(err, store.ErrFull):
		s.log(ctx, slog.LevelError, op+" refused: the store is full; Internal is recorded instead of the reply", c, err)
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
// maximum lease; a call without a deadline gets the default lease. It
// saturates: gRPC turns a grpc-timeout above about 2562047H into a deadline
// math.MaxInt64 nanoseconds away, to which the grace cannot be added.
func (s *server) lease(ctx context.Context) time.Duration {
	deadline, ok := ctx.Deadline()
	if !ok {
		return s.opts.lease
	}
	left := max(time.Until(deadline), 0)
	if left > s.opts.maxLease-leaseGrace {
		return s.opts.maxLease
	}
	return left + leaseGrace
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
