package idemhttp

import (
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"

	"github.com/idemkey/idemkey/store"
)

// defaultMaxBodySize bounds the request body read for the fingerprint
// unless WithMaxBodySize sets another, in bytes.
const defaultMaxBodySize = 1 << 20

// Option configures the middleware: its own settings. Those every entry
// point shares (the tenant, whether a key is required, leases, retention,
// the record's bound, sealing, hooks, metrics, logging) are the engine's,
// set once with engine.New.
type Option func(*options)

// FingerprintFunc returns the fingerprint of a request whose body is body (the
// whole of it, which the handler gets too). A retry must fingerprint the
// same; any other request with the same key, differently. An error answers
// 400 (ReasonRequestUnreadable): the request cannot be read as its operation
// expects. The error is never sent, and only its type is logged: its words
// may quote the request.
type FingerprintFunc func(r *http.Request, body []byte) (store.Fingerprint, error)

type options struct {
	methods   map[string]bool
	operation func(r *http.Request) string
	maxBody   int64
	recorded  func(status int) bool
	replayed  map[string]bool // canonical header names
	// The replay list, sorted by name, and by the lower-case names records
	// hold, for a record's encoding and its replay (record.go).
	replayList   []replayedName
	replayedWire map[string]string // lower-case name -> canonical name
	fingerprint  FingerprintFunc   // nil: DefaultFingerprint's
	atomic       bool
	redact       RedactFunc
	err          error // the first option refused
}

func newOptions(opts []Option) *options {
	o := &options{
		methods:   map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		operation: DefaultOperation,
		maxBody:   defaultMaxBodySize,
		recorded:  defaultRecorded,
		replayed:  map[string]bool{"Content-Type": true, "Content-Encoding": true, "Content-Language": true, "Location": true},
	}
	for _, opt := range opts {
		opt(o)
	}
	o.replayedWire = make(map[string]string, len(o.replayed))
	for _, c := range slices.Sorted(maps.Keys(o.replayed)) {
		n := replayedName{canonical: c, wire: strings.ToLower(c)}
		o.replayList = append(o.replayList, n)
		o.replayedWire[n.wire] = c
	}
	return o
}

func (o *options) refuse(err error) {
	if o.err == nil {
		o.err = err
	}
}

// WithMethods sets the methods covered; requests with other methods pass
// through untouched. The default is POST and PATCH, the methods HTTP does not
// define as idempotent.
func WithMethods(methods ...string) Option {
	return func(o *options) {
		o.methods = make(map[string]bool, len(methods))
		for _, m := range methods {
			o.methods[m] = true
		}
	}
}

// WithOperation sets how a request's operation is named: the name scopes its
// keys (with the tenant), labels its metrics and enters its fingerprint. An
// empty name lets the request pass through untouched. The default is
// Operation.
//
// Names must come from a small, fixed set, such as route patterns or gRPC
// method names, never from the raw path: each name is kept, and a caller
// could mint names without end (past 1024 names, operations are no longer
// kept but built for each request).
//
// The middleware records HTTP responses, which a gRPC or Connect replay
// cannot rebuild, nor it theirs: to share keys with a gRPC method, serve the
// route as a gateway to the gRPC service, as the example server's
// POST /v1/charges does, rather than through this middleware.
func WithOperation(f func(r *http.Request) string) Option {
	return func(o *options) {
		if f != nil {
			o.operation = f
		}
	}
}

// WithMaxBodySize bounds the request body read (1 MiB if n < 1): the body is read whole before the key is reserved, for the
// fingerprint. A larger body, or a Content-Length that announces one, is
// answered 413 (ReasonRequestTooLarge) and nothing is reserved.
func WithMaxBodySize(n int64) Option {
	return func(o *options) {
		if n < 1 {
			n = defaultMaxBodySize
		}
		o.maxBody = n
	}
}

// WithRecordedStatuses sets the status codes whose responses are recorded and
// replayed to retries; a response with any other status releases the key, so
// that a retry runs the handler again. By default every status below 400 is
// recorded, and the final answers 404 Not Found, 410 Gone, 412 Precondition
// Failed, 500 Internal Server Error and 501 Not Implemented, as the gRPC
// adapter records NotFound, FailedPrecondition, Internal and Unimplemented.
// Every other status releases the key: one that the caller corrects and
// retries (400, 401, 403, 409, 413, 415, 422), and one that says "not now"
// (408, 425, 429, 502, 503, 504).
func WithRecordedStatuses(statuses ...int) Option {
	set := make(map[int]bool, len(statuses))
	for _, s := range statuses {
		set[s] = true
	}
	return func(o *options) { o.recorded = func(status int) bool { return set[status] } }
}

// defaultRecorded reports whether a response with status is recorded when
// WithRecordedStatuses does not say.
func defaultRecorded(status int) bool {
	switch {
	case status < 400:
		return true
	case status == http.StatusNotFound, status == http.StatusGone, status == http.StatusPreconditionFailed,
		status == http.StatusInternalServerError, status == http.StatusNotImplemented:
		return true
	}
	return false
}

// neverReplayed are header fields that a replay never repeats: a session
// cookie, the replay marker and the key's expiry, which each answer sets
// itself, and the fields that frame a message.
var neverReplayed = map[string]bool{
	"Set-Cookie": true, "Idempotent-Replayed": true, "Idempotency-Key-Expires": true, "Content-Length": true, "Transfer-Encoding": true,
	"Connection": true, "Keep-Alive": true, "Trailer": true, "Te": true, "Upgrade": true,
	"Proxy-Connection": true, "Proxy-Authenticate": true,
}

// WithReplayedHeaders adds header fields to those recorded with a response
// and replayed: by default Content-Type, Content-Encoding, Content-Language
// and Location, which describe the body or point to what was made. Other
// fields the handler sets reach the first caller only. Set-Cookie and the
// fields that frame a message (Content-Length, Transfer-Encoding, Connection,
// Trailer...) are never replayed: Middleware refuses them.
//
// A replay sends the fields on today's list: a field taken off the list stops
// being replayed from records made before.
func WithReplayedHeaders(names ...string) Option {
	return func(o *options) {
		for _, n := range names {
			c := http.CanonicalHeaderKey(strings.TrimSpace(n))
			switch {
			case c == "" || strings.ContainsAny(c, " \t:\r\n"):
				o.refuse(fmt.Errorf("idemhttp: WithReplayedHeaders: %q is not a header field name", n))
			case neverReplayed[c]:
				o.refuse(fmt.Errorf("idemhttp: WithReplayedHeaders: %s is never replayed", c))
			default:
				o.replayed[c] = true
			}
		}
	}
}

// WithFingerprint sets how a request is fingerprinted; the default is
// DefaultFingerprint. A function that hashes less (leaving out a client timestamp,
// say) lets requests that differ there share a key.
func WithFingerprint(f FingerprintFunc) Option {
	return func(o *options) {
		if f != nil {
			o.fingerprint = f
		}
	}
}

// Reply is what is recorded of a response, and replayed to its retries, as
// a RedactFunc sees it and may change it.
type Reply struct {
	// Status is the response's status. A RedactFunc may change it to
	// another final status (200 to 999).
	Status int
	// Header is a copy of the header fields the response had on the replay
	// list (WithReplayedHeaders): a field added that is not on the list is
	// not replayed.
	Header http.Header
	// Body is a copy of the response's body.
	Body []byte
}

// RedactFunc removes from reply what must not be recorded: fields of a
// JSON body (a card number, a vended credential), header fields. r is the
// request, whose body the handler has read; OperationName(r.Context())
// names its operation.
type RedactFunc func(r *http.Request, reply *Reply)

// WithRedaction calls f on what is about to be recorded of each response
// that is recorded, after the handler and before the store, so that what f
// removes is never stored. The first caller gets the handler's response,
// whole; every retry with the key gets the redacted one, as recorded, with
// Idempotent-Replayed: true. So remove only what a retry can do without,
// and make the API's clients expect it (document it with the route).
//
// f runs synchronously, on a copy: it may keep nothing of reply. A panic in
// f, or a status it leaves that is not final, records a 500 in place of the
// response, which the caller gets too, as every retry will: the handler has
// run, so its key is not released. Such a panic is logged with its value's
// type, never the value, which may quote the response. The 500 that idemkey records in place of
// a response too large to record is never given to f.
func WithRedaction(f RedactFunc) Option { return func(o *options) { o.redact = f } }

// WithAtomic runs covered requests in atomic mode: the handler's writes, made
// through the transaction its r.Context() carries (postgres.TxFromContext),
// commit in one transaction with the key's reservation and record. A
// recorded status of 400 or more (a 404, say) commits the record but undoes
// the writes. The engine's store must implement store.Atomic: Middleware
// refuses one that does not.
func WithAtomic() Option { return func(o *options) { o.atomic = true } }
