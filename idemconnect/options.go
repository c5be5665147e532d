package idemconnect

import (
	"context"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// Option configures the server interceptor. Settings every entry point
// shares are the engine's (engine.New).
type Option interface{ applyServer(*options) }

// ProcedureOption configures which procedures both interceptors cover.
type ProcedureOption interface {
	Option
	applyClient(*rpckit.Coverage)
}

// FingerprintFunc hashes what makes a request "the same request".
type FingerprintFunc func(procedure string, req proto.Message) (store.Fingerprint, error)

// options is never modified after construction.
type options = rpckit.Settings[FingerprintFunc, RedactFunc]

var naming = rpckit.Naming{Constructor: "NewServerInterceptor", Included: "WithIncludedProcedures",
	Excluded: "WithExcludedProcedures", Atomic: "WithAtomicProcedures", Retention: "WithProcedureRetention", Method: "procedure"}

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type procedureOption func(*rpckit.Coverage)

func (f procedureOption) applyServer(o *options)         { f(&o.Coverage) }
func (f procedureOption) applyClient(c *rpckit.Coverage) { f(c) }

// WithRecordedCodes is interceptor.WithRecordedCodes, with the same default.
func WithRecordedCodes(codes ...connect.Code) Option {
	return serverOption(func(o *options) { o.Recorded = rpckit.CodeSet(codes...) })
}

// WithReplayedHeaders records and replays the response headers and trailers
// the handler sets under the given names (any case). Every caller of the
// tenant who resends the key gets them, so never list a header of one
// caller's, such as a cookie.
func WithReplayedHeaders(names ...string) Option {
	return serverOption(func(o *options) { o.Replay(names) })
}

// WithFingerprint replaces protokey.HashRequest (keys are shared with gRPC
// only if both fingerprint alike). A *connect.Error goes to the caller as it
// is; any other becomes Internal, logged by its type alone.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.Fingerprint = f })
}

// WithRedaction is interceptor.WithRedaction (a panic in f is logged by its
// value's type alone): give the gRPC interceptor the same redaction.
func WithRedaction(f RedactFunc) Option {
	return serverOption(func(o *options) { o.Redact = f })
}

// Reply is interceptor.Reply for Connect: Header and Trailer hold the
// WithReplayedHeaders names, "-bin" values decoded.
type Reply struct {
	Response        proto.Message
	Err             error
	Header, Trailer http.Header
}

// RedactFunc removes from reply what must not be recorded.
type RedactFunc func(ctx context.Context, procedure string, reply *Reply)

// WithAtomic runs every covered procedure in atomic mode, as
// interceptor.WithAtomic; the store must implement store.Atomic.
func WithAtomic() Option {
	return serverOption(func(o *options) { o.AtomicAll = true })
}

// WithAtomicProcedures runs the given procedures in atomic mode.
func WithAtomicProcedures(procedures ...string) Option {
	return serverOption(func(o *options) { o.Atomic = rpckit.Add(o.Atomic, procedures...) })
}

// WithProcedureRetention keeps the records of the given covered procedures
// for d, in place of the engine's retention, as
// interceptor.WithMethodRetention.
func WithProcedureRetention(d time.Duration, procedures ...string) Option {
	return serverOption(func(o *options) { o.Retention = rpckit.AddRetention(o.Retention, d, procedures...) })
}

func canonical(name string) string { return http.CanonicalHeaderKey(name) }
