package idemconnect

import (
	"context"
	"net/http"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/protokey/rpckit"
	"github.com/idemkey/idemkey/store"
)

// Option configures the server interceptor: the Connect adapter's own
// settings. Those every entry point shares (tenant, key required, leases,
// retention, sealing, hooks, metrics, logging) are the engine's, set once
// with engine.New.
type Option interface{ applyServer(*options) }

// ProcedureOption configures both interceptors: which procedures are
// covered. The client interceptor takes only these.
type ProcedureOption interface {
	Option
	applyClient(*rpckit.Coverage)
}

// FingerprintFunc hashes the parts of a request that make it "the same
// request". The default is protokey.HashRequest, which the gRPC interceptor
// uses too, so that a request fingerprints the same over either.
type FingerprintFunc func(procedure string, req proto.Message) (store.Fingerprint, error)

// options is shared by every call of one server interceptor; it is never
// modified after construction (NewServerInterceptor makes it): the settings
// the gRPC interceptor has too, with the same defaults, and this adapter's
// fingerprint and redaction.
type options = rpckit.Settings[FingerprintFunc, RedactFunc]

// naming is how the errors of rpckit.Check name this adapter's options.
var naming = rpckit.Naming{Constructor: "NewServerInterceptor", Included: "WithIncludedProcedures",
	Excluded: "WithExcludedProcedures", Atomic: "WithAtomicProcedures", Method: "procedure"}

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type procedureOption func(*rpckit.Coverage)

func (f procedureOption) applyServer(o *options)         { f(&o.Coverage) }
func (f procedureOption) applyClient(c *rpckit.Coverage) { f(c) }

// WithRecordedCodes sets the error codes whose outcome is recorded and
// replayed; a handler error with any other code releases the key so that a
// retry runs the handler again. A success is always recorded. The default,
// as in the gRPC interceptor, is NotFound, AlreadyExists,
// FailedPrecondition, OutOfRange, Unimplemented, Internal, Unknown and
// DataLoss.
func WithRecordedCodes(codes ...connect.Code) Option {
	return serverOption(func(o *options) { o.Recorded = rpckit.CodeSet(codes...) })
}

// WithReplayedHeaders records the response headers and trailers the handler
// sets under the given names (any case; "-bin" names are decoded, as gRPC
// metadata is binary there) and replays them with the outcome. By default
// none is replayed. A replay sends only the names listed now.
//
// A replay goes to every caller of the tenant who resends the key, so never
// list a header that belongs to one caller, such as a cookie.
func WithReplayedHeaders(names ...string) Option {
	return serverOption(func(o *options) { o.Replay(names) })
}

// WithFingerprint replaces protokey.HashRequest, for example to leave out a
// field the client sets anew on every attempt. An error that is a
// *connect.Error goes to the caller as it is; any other becomes Internal,
// and is logged by its type alone, since its words may quote the request.
// Keys are shared with the gRPC interceptor only if both fingerprint alike.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.Fingerprint = f })
}

// WithRedaction calls f on what is about to be recorded of each call whose
// reply is recorded, after the handler and before the store, so that what
// f removes is never stored. The first caller gets the handler's reply,
// whole; every retry with the key gets the redacted one, as recorded, over
// any transport that shares the record (gRPC too). So remove only what a
// retry can do without, and make the reply's clients expect it.
//
// f runs synchronously, on a copy: it may keep nothing of reply. A panic in
// f (logged by its value's type alone: the value may quote the reply), or a
// reply it leaves that cannot be recorded (no response, a response of
// another type, an error turned into a response), records Internal in place
// of the reply, which the caller gets too, as every retry will: the
// handler has run, so its key is not released. Give the gRPC interceptor
// the same redaction (interceptor.WithRedaction), so that a record is the
// same whichever transport made it.
func WithRedaction(f RedactFunc) Option {
	return serverOption(func(o *options) { o.Redact = f })
}

// Reply is what is recorded of a call, and replayed to its retries, as a
// RedactFunc sees it and may change it.
type Reply struct {
	// Response is a copy of the handler's response message, nil if it
	// returned an error. Change it in place, or replace it with a message
	// of the same type.
	Response proto.Message
	// Err is the handler's error, of a code that is recorded, nil if it
	// returned a response. Replace it to record another error (say, a
	// *connect.Error with another message, or without details), or set it
	// in place of a response to record an error instead; an error cannot
	// become a response.
	Err error
	// Header and Trailer are copies of the headers and trailers the handler
	// set under the names of WithReplayedHeaders, values of "-bin" names
	// decoded; nil if none.
	Header, Trailer http.Header
}

// RedactFunc removes from reply what must not be recorded: fields of the
// response (a card number, a vended credential), words of an error's
// message, headers. procedure is the call's ("/package.Service/Method").
type RedactFunc func(ctx context.Context, procedure string, reply *Reply)

// WithAtomic runs every covered procedure in atomic mode, as the gRPC
// interceptor's WithAtomic does; WithAtomicProcedures chooses some. The
// engine's store must implement store.Atomic (store/postgres does), else
// NewServerInterceptor returns an error.
func WithAtomic() Option {
	return serverOption(func(o *options) { o.AtomicAll = true })
}

// WithAtomicProcedures runs the given procedures in atomic mode; see
// WithAtomic.
func WithAtomicProcedures(procedures ...string) Option {
	return serverOption(func(o *options) { o.Atomic = rpckit.Add(o.Atomic, procedures...) })
}

// canonical is the http.Header form of a lower-case name.
func canonical(name string) string { return http.CanonicalHeaderKey(name) }
