package idemconnect

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

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
	applyClient(*clientOptions)
}

// FingerprintFunc hashes the parts of a request that make it "the same
// request". The default is protokey.HashRequest, which the gRPC interceptor
// uses too, so that a request fingerprints the same over either.
type FingerprintFunc func(procedure string, req proto.Message) (store.Fingerprint, error)

// coverage is what both interceptors read: the procedures forced in or out.
type coverage struct {
	included map[string]bool
	excluded map[string]bool
	keyField *string // WithKeyField, WithAnnotatedKeyField; nil: none
}

// options is shared by every call of one server interceptor; it is never
// modified after construction.
type options struct {
	coverage
	fingerprint FingerprintFunc // nil: protokey's, without the key field
	recorded    map[connect.Code]bool
	replayed    map[string]bool // lower-case header names replayed from the record
	atomicAll   bool
	atomic      map[string]bool
	redact      RedactFunc
}

type clientOptions struct {
	coverage
}

// defaultRecorded are the error codes whose outcome is final, as in the gRPC
// interceptor: a retry would get the same answer, so it gets the recorded
// one. Every other code releases the key.
var defaultRecorded = []connect.Code{
	connect.CodeNotFound, connect.CodeAlreadyExists, connect.CodeFailedPrecondition, connect.CodeOutOfRange,
	connect.CodeUnimplemented, connect.CodeInternal, connect.CodeUnknown, connect.CodeDataLoss,
}

func newOptions(opts []Option) *options {
	o := &options{recorded: codeSet(defaultRecorded)}
	for _, opt := range opts {
		opt.applyServer(o)
	}
	return o
}

func newClientOptions(opts []ProcedureOption) *clientOptions {
	o := &clientOptions{}
	for _, opt := range opts {
		opt.applyClient(o)
	}
	return o
}

type serverOption func(*options)

func (f serverOption) applyServer(o *options) { f(o) }

type procedureOption func(*coverage)

func (f procedureOption) applyServer(o *options)       { f(&o.coverage) }
func (f procedureOption) applyClient(o *clientOptions) { f(&o.coverage) }

// WithIncludedProcedures covers the given procedures ("/package.Service/Method")
// whatever their idempotency level says.
func WithIncludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *coverage) { c.included = addAll(c.included, procedures...) })
}

// WithExcludedProcedures leaves the given procedures uncovered: they pass
// through untouched. It wins over WithIncludedProcedures.
func WithExcludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *coverage) { c.excluded = addAll(c.excluded, procedures...) })
}

// WithKeyField takes the idempotency key from the request field name too, as
// AIP-155 does with request_id, in every covered procedure whose request has
// a singular string field of that name. It works as the gRPC interceptor's
// WithKeyField: a request whose field and Idempotency-Key header carry
// different keys is refused (IDEMPOTENCY_KEY_INVALID), and the default
// fingerprint leaves the field out, so keys are shared with the gRPC
// interceptor only if both are given the same field. The client interceptor
// adds no key to a request that sets the field.
func WithKeyField(name string) ProcedureOption {
	return procedureOption(func(c *coverage) { c.keyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for the field AIP-155 describes: a
// request_id annotated (google.api.field_info).format = UUID4 (AIP-202).
func WithAnnotatedKeyField() ProcedureOption {
	return procedureOption(func(c *coverage) { c.keyField = new(string) })
}

// WithFingerprint replaces protokey.HashRequest, for example to leave out a
// field the client sets anew on every attempt. An error that is a
// *connect.Error goes to the caller as it is; any other becomes Internal,
// and is logged by its type alone, since its words may quote the request.
// Keys are shared with the gRPC interceptor only if both fingerprint alike.
func WithFingerprint(f FingerprintFunc) Option {
	return serverOption(func(o *options) { o.fingerprint = f })
}

// WithRecordedCodes sets the error codes whose outcome is recorded and
// replayed; a handler error with any other code releases the key so that a
// retry runs the handler again. A success is always recorded. The default,
// as in the gRPC interceptor, is NotFound, AlreadyExists,
// FailedPrecondition, OutOfRange, Unimplemented, Internal, Unknown and
// DataLoss.
func WithRecordedCodes(codes ...connect.Code) Option {
	return serverOption(func(o *options) { o.recorded = codeSet(codes) })
}

// WithReplayedHeaders records the response headers and trailers the handler
// sets under the given names (any case; "-bin" names are decoded, as gRPC
// metadata is binary there) and replays them with the outcome. By default
// none is replayed. A replay sends only the names listed now.
//
// A replay goes to every caller of the tenant who resends the key, so never
// list a header that belongs to one caller, such as a cookie.
func WithReplayedHeaders(names ...string) Option {
	return serverOption(func(o *options) {
		for _, n := range names {
			o.replayed = addAll(o.replayed, strings.ToLower(n))
		}
	})
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
	return serverOption(func(o *options) { o.redact = f })
}

// WithAtomic runs every covered procedure in atomic mode, as the gRPC
// interceptor's WithAtomic does; WithAtomicProcedures chooses some. The
// engine's store must implement store.Atomic (store/postgres does), else
// NewServerInterceptor returns an error.
func WithAtomic() Option {
	return serverOption(func(o *options) { o.atomicAll = true })
}

// WithAtomicProcedures runs the given procedures in atomic mode; see
// WithAtomic.
func WithAtomicProcedures(procedures ...string) Option {
	return serverOption(func(o *options) { o.atomic = addAll(o.atomic, procedures...) })
}

func codeSet(cs []connect.Code) map[connect.Code]bool {
	set := make(map[connect.Code]bool, len(cs))
	for _, c := range cs {
		set[c] = true
	}
	return set
}

func addAll(set map[string]bool, items ...string) map[string]bool {
	if set == nil {
		set = make(map[string]bool, len(items))
	}
	for _, it := range items {
		set[it] = true
	}
	return set
}

// canonical is the http.Header form of a lower-case name.
func canonical(name string) string { return http.CanonicalHeaderKey(name) }
