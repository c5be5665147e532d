package idemhttp

import (
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemkey/idemkey/store"
)

const defaultMaxBodySize = 1 << 20

// Option configures the middleware. Settings every entry point shares are
// the engine's (engine.New).
type Option func(*options)

// FingerprintFunc returns the fingerprint of r, whose whole body is body. An
// error answers 400 (ReasonRequestUnreadable); it is never sent, and only its
// type is logged, as its words may quote the request.
type FingerprintFunc func(r *http.Request, body []byte) (store.Fingerprint, error)

type options struct {
	methods   map[string]bool
	operation func(r *http.Request) string
	maxBody   int64
	recorded  func(status int) bool
	replayed  map[string]bool // canonical header names
	// The replay list, sorted, and by the lower-case names records hold.
	replayList   []replayedName
	replayedWire map[string]string // lower-case name -> canonical name
	fingerprint  FingerprintFunc   // nil: DefaultFingerprint's
	atomic       bool
	retention    time.Duration // WithRetention; 0: the engine's
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

// WithMethods sets the methods covered; the default is POST and PATCH.
func WithMethods(methods ...string) Option {
	return func(o *options) {
		o.methods = make(map[string]bool, len(methods))
		for _, m := range methods {
			o.methods[m] = true
		}
	}
}

// WithOperation sets how a request's operation is named (DefaultOperation by
// default): the name scopes its keys, labels its metrics and enters its
// fingerprint; an empty name passes the request through. Names must come
// from a small, fixed set, such as route patterns, never the raw path.
func WithOperation(f func(r *http.Request) string) Option {
	return func(o *options) {
		if f != nil {
			o.operation = f
		}
	}
}

// WithRetention keeps the records of the middleware's operations for d, in
// place of the engine's retention (engine.WithRetention): their keys'
// expiry, the refusal of a retry first sent longer ago, and the sweep follow
// it. Give each route its own middleware for a retention of its own.
func WithRetention(d time.Duration) Option { return func(o *options) { o.retention = max(d, 0) } }

// WithMaxBodySize bounds the request body, read whole before the key is
// reserved (1 MiB if n < 1). A larger one is answered 413
// (ReasonRequestTooLarge) and nothing is reserved.
func WithMaxBodySize(n int64) Option {
	return func(o *options) {
		if n < 1 {
			n = defaultMaxBodySize
		}
		o.maxBody = n
	}
}

// WithRecordedStatuses sets the statuses whose responses are recorded and
// replayed; any other releases the key. By default every status below 400,
// and 404, 410, 412, 500 and 501, the final answers.
func WithRecordedStatuses(statuses ...int) Option {
	set := make(map[int]bool, len(statuses))
	for _, s := range statuses {
		set[s] = true
	}
	return func(o *options) { o.recorded = func(status int) bool { return set[status] } }
}

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

// neverReplayed are header fields a replay never repeats: a session cookie,
// those each answer sets itself, and those that frame a message.
var neverReplayed = map[string]bool{
	"Set-Cookie": true, "Idempotent-Replayed": true, "Idempotency-Key-Expires": true, "Idempotency-Status": true,
	"Content-Length": true, "Transfer-Encoding": true, "Connection": true, "Keep-Alive": true, "Trailer": true,
	"Te": true, "Upgrade": true, "Proxy-Connection": true, "Proxy-Authenticate": true,
}

// WithReplayedHeaders adds header fields to those recorded and replayed
// (Content-Type, Content-Encoding, Content-Language and Location); others
// reach the first caller only. Middleware refuses Set-Cookie and the fields
// that frame a message. A replay sends the fields on today's list.
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

// WithFingerprint replaces DefaultFingerprint.
func WithFingerprint(f FingerprintFunc) Option {
	return func(o *options) {
		if f != nil {
			o.fingerprint = f
		}
	}
}

// Reply is what is recorded of a response, as a RedactFunc sees and may
// change it: the status (another final one, 200 to 999, may replace it), a
// copy of the header fields on the replay list (a field off the list is not
// replayed) and a copy of the body.
type Reply struct {
	Status int
	Header http.Header
	Body   []byte
}

// RedactFunc removes from reply what must not be recorded. r's body has been
// read; OperationName(r.Context()) names its operation.
type RedactFunc func(r *http.Request, reply *Reply)

// WithRedaction calls f on a copy of each response before it is recorded, so
// that what f removes is never stored: the first caller gets the whole
// response, every retry the redacted one. A panic in f (logged by its value's
// type alone), or a status it leaves that is not final, records a 500, which
// the first caller gets too: the key is not released.
func WithRedaction(f RedactFunc) Option { return func(o *options) { o.redact = f } }

// WithAtomic runs covered requests in atomic mode: the handler's writes
// through postgres.TxFromContext(r.Context()) commit with the key's record; a
// recorded status of 400 or more commits the record but undoes the writes.
// The store must implement store.Atomic.
func WithAtomic() Option { return func(o *options) { o.atomic = true } }
