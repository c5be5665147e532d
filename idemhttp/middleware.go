package idemhttp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Middleware returns net/http middleware that runs each covered request at
// most once per idempotency key on eng, and replays its recorded response to
// every retry. eng holds the settings every entry point shares (engine.New:
// the store, the tenant, whether a key is required, leases, retention,
// sealing, hooks, metrics); its TenantFunc reads r.Context(), where an
// authentication middleware put the caller's identity. opts are the
// middleware's own. See the package documentation for what is covered and
// answered.
//
// It returns an error for a mistake to catch at start-up: a nil eng, an
// engine that cannot tell tenants apart (engine.WithTenant or
// engine.WithSingleTenant), WithAtomic on a store that does not implement
// store.Atomic, or a header WithReplayedHeaders may not replay.
func Middleware(eng *engine.Engine, opts ...Option) (func(http.Handler) http.Handler, error) {
	if eng == nil {
		return nil, errors.New("idemhttp: Middleware needs an engine: engine.New(store, engine.WithTenant(...))")
	}
	o := newOptions(opts)
	if o.err != nil {
		return nil, o.err
	}
	if _, err := eng.Operation(engine.OperationSpec{Atomic: o.atomic}); err != nil {
		return nil, err
	}
	m := &middleware{eng: eng, opts: o}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
	}, nil
}

// middleware translates HTTP requests into the engine's request path and
// back: where the key comes from (the Idempotency-Key field), how a request
// is fingerprinted, how a response is recorded (capture.go) and replayed,
// and how each verdict is answered (problem.go).
type middleware struct {
	eng  *engine.Engine
	opts *options

	ops      sync.Map // opKey -> *engine.Operation
	nops     atomic.Int64
	warnOnce sync.Once // logs once that operations are no longer kept
}

// maxOperations bounds the operations kept; past it they are built for each
// request (see WithOperation).
const maxOperations = 1024

type opKey struct{ method, name, pattern string }

// operation returns the engine's operation of a request named name; kept is
// false if it was built for this request alone.
func (m *middleware) operation(r *http.Request, name string) (op *engine.Operation, kept bool) {
	k := opKey{r.Method, name, r.Pattern}
	if op, ok := m.ops.Load(k); ok {
		return op.(*engine.Operation), true
	}
	attrs := []attribute.KeyValue{attribute.String("http.request.method", r.Method)}
	if route := route(r.Pattern); route != "" {
		attrs = append(attrs, attribute.String("http.route", route))
	}
	op, err := m.eng.Operation(engine.OperationSpec{Name: name, Atomic: m.opts.atomic,
		Metrics: engine.MetricsSpec{Attributes: attrs, Status: statusAttr}})
	if err != nil {
		panic(err) // Middleware checked that the engine serves this mode
	}
	if m.nops.Load() >= maxOperations {
		return op, false
	}
	if prev, loaded := m.ops.LoadOrStore(k, op); loaded {
		return prev.(*engine.Operation), true
	}
	m.nops.Add(1)
	return op, true
}

func statusAttr(code int) attribute.KeyValue { return attribute.Int("http.response.status_code", code) }

// route is the path template of a ServeMux pattern ("[METHOD ][HOST]/PATH"),
// the value of http.route: "/v1/charges/{id}" for "POST /v1/charges/{id}".
func route(pattern string) string {
	if _, rest, ok := strings.Cut(pattern, " "); ok {
		pattern = strings.TrimLeft(rest, " \t")
	}
	if i := strings.IndexByte(pattern, '/'); i >= 0 {
		return pattern[i:]
	}
	return ""
}

// DefaultOperation is the default operation name of a request
// (WithOperation): the pattern of the http.ServeMux route that matched it,
// such as "POST /v1/charges", else its method alone.
//
// r.Pattern is set only for a handler the mux calls: wrap each handler as
// you register it, mux.Handle("POST /v1/charges", mw(h)). Middleware
// wrapped around the whole mux sees no pattern, so every request of one
// method is one operation: a key then names one request of its tenant
// across every path (the fingerprint covers the path, so a key sent again
// to another path is refused as reused), as Stripe's keys do. Naming an
// operation after the raw path instead would let callers mint operations.
func DefaultOperation(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.Method
}

// DefaultFingerprint is the default fingerprint (WithFingerprint): the SHA-256 of
// "idemhttp v1", the method, the operation name, the escaped path, the raw
// query, the media type of the Content-Type in lower case (without its
// parameters) and the body, each with its length in front
// (store.AppendParts). Two requests that differ in any of them differ; so do
// one sent to an HTTP route and one to a gRPC method, whatever their names.
func DefaultFingerprint(r *http.Request, body []byte) (store.Fingerprint, error) {
	mediaType, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		mediaType = strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Type")))
	}
	h := sha256.New()
	h.Write(store.AppendParts(make([]byte, 0, 256), "idemhttp v1", r.Method, OperationName(r.Context()),
		r.URL.EscapedPath(), r.URL.RawQuery, mediaType))
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(len(body)))) // store.AppendParts, for bytes
	h.Write(body)
	return store.Fingerprint(h.Sum(nil)), nil
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if !m.opts.methods[r.Method] {
		next.ServeHTTP(w, r)
		return
	}
	name := m.opts.operation(r)
	if name == "" {
		next.ServeHTTP(w, r)
		return
	}
	op, kept := m.operation(r, name)
	if !kept {
		m.warnOnce.Do(func() {
			m.eng.Logger().LogAttrs(r.Context(), slog.LevelWarn,
				"idemkey: more than 1024 operation names: operations are no longer kept; WithOperation should name routes, never paths",
				slog.String("operation", name))
		})
	}
	x := &exchange{m: m, r: r, w: w, next: next, name: name, rec: statusRecorder{ResponseWriter: w}}
	m.eng.Serve(&nameContext{r.Context(), name}, op, x)
	if x.send != nil { // the middleware's own answer, once the hooks have run
		x.send(w)
	}
}

// exchange is one covered request, as engine.Serve reads and answers it.
// The middleware's own answers (a recorded, replayed or problem response)
// are prepared by Answer and sent, by send, only after Serve has run the
// hooks, so that a client that has the answer knows they have returned; a
// response the handler writes itself (Pass: no key, or failed open) goes
// out as it writes it, through rec, before them.
type exchange struct {
	m    *middleware
	r    *http.Request
	w    http.ResponseWriter
	next http.Handler
	name string
	rec  statusRecorder // the handler's writes, for Pass

	body    []byte   // the request body, read for the fingerprint
	read    bool     // body was read: the handler gets it, not r.Body
	ran     bool     // the handler ran (Run)
	cw      *capture // the handler's buffered response, for Run
	standIn *capture // the 500 recorded in its place, if it could not be

	send func(w http.ResponseWriter) // the answer Answer prepared
}

func (x *exchange) Key() (string, bool, error) { return KeyFromHeader(x.r.Header) }

func (x *exchange) FirstSent() []string { return x.r.Header.Values(idemkey.FirstSentHeader) }

// Attempt is the zero Attempt: HTTP does not say which attempt a request is.
func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{} }

// Fingerprint reads the request body whole, up to WithMaxBodySize, and
// fingerprints the request with it. Its error is a *refusal, which Answer
// writes as its problem.
func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	body, status, err := readBody(&x.rec, x.r, x.m.opts.maxBody)
	if err != nil {
		reason := ReasonRequestUnreadable
		if status == http.StatusRequestEntityTooLarge {
			reason = ReasonRequestTooLarge
		}
		return store.Fingerprint{}, &refusal{status: status, reason: reason, detail: err.Error()}
	}
	x.body, x.read = body, true
	fp, err := x.m.opts.fingerprint(x.request(ctx), body)
	if err != nil {
		// The FingerprintFunc's own words may quote the request.
		x.m.eng.Logger().LogAttrs(ctx, slog.LevelWarn, "idemkey: fingerprint refused the request", slog.String("operation", x.name),
			slog.String("error", fmt.Sprintf("an error of type %T (its words are not logged: they may quote the request)", err)))
		return store.Fingerprint{}, &refusal{status: http.StatusBadRequest, reason: ReasonRequestUnreadable, detail: "the request could not be fingerprinted"}
	}
	return fp, nil
}

// Run runs the handler into a buffer (capture), so that the first caller
// gets exactly what is recorded and replayed to every retry. In atomic mode
// only a status below 400 keeps the handler's writes.
func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	x.ran = true
	o := x.m.opts
	x.cw = newCapture(x.w, x.m.eng.MaxRecordSize())
	r := x.request(ctx)
	x.next.ServeHTTP(x.cw, r)
	x.cw.finish()
	switch {
	case x.cw.tooBig:
		return engine.HandlerResult{Unrecordable: errResponseTooLarge}
	case !o.recorded(x.cw.status):
		return engine.HandlerResult{Release: true}
	}
	outcome, err := encodeResponse(r, x.cw, o.replayed, o.redact)
	return engine.HandlerResult{Record: outcome, KeepWrites: x.cw.status < 400, Unrecordable: err}
}

func (x *exchange) StandIn(why error) []byte {
	pw, outcome := x.m.standIn(x.w, why)
	x.standIn = pw
	return outcome
}

// Pass runs the handler unprotected, writing straight to the client, and
// returns the status it wrote.
func (x *exchange) Pass(ctx context.Context) int {
	x.next.ServeHTTP(&x.rec, x.request(ctx))
	if x.rec.status == 0 {
		return http.StatusOK
	}
	return x.rec.status
}

// Answer prepares the answer a says, for serve to send once the hooks have
// run, and returns its status.
func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	status, send := x.answer(ctx, a)
	x.send = send
	return status
}

// answer is the status of a's answer, and how to send it.
func (x *exchange) answer(ctx context.Context, a engine.Answer) (int, func(http.ResponseWriter)) {
	switch a.Verdict {
	case engine.Executed:
		cw := x.cw
		if a.StandIn != nil {
			cw = x.standIn // StandIn made it
		}
		setExpires(cw.header, a.Expires) // after its record: the expiry is each answer's own
		return cw.status, cw.send
	case engine.Replayed:
		return x.replay(ctx, a)
	case engine.InProgress:
		return problem(http.StatusConflict, idemkey.ReasonInProgress,
			"a request with this Idempotency-Key is being processed; retry after the time given", a.RetryAfter, a.Expires)
	case engine.Reused:
		return problem(http.StatusUnprocessableEntity, idemkey.ReasonKeyReused,
			"this Idempotency-Key was first used with another request", 0, a.Expires)
	case engine.KeyMissing:
		return problem(http.StatusBadRequest, idemkey.ReasonKeyMissing, "this operation requires an Idempotency-Key header", 0, time.Time{})
	case engine.KeyInvalid:
		return problem(http.StatusBadRequest, idemkey.ReasonKeyInvalid, a.Err.Error(), 0, time.Time{}) // never quotes the key
	case engine.FirstSentInvalid:
		return problem(http.StatusBadRequest, idemkey.ReasonFirstSentInvalid, a.Err.Error(), 0, time.Time{}) // never quotes the value
	case engine.Expired:
		return problem(http.StatusPreconditionFailed, idemkey.ReasonKeyExpired,
			"the operation of this Idempotency-Key was first sent longer ago than keys are kept, and has no record; it was not run", 0, time.Time{})
	case engine.StoreFull:
		return problem(http.StatusServiceUnavailable, idemkey.ReasonStoreFull,
			"the idempotency store has no room for a new key; retry later", a.RetryAfter, time.Time{})
	case engine.Refused:
		var ref *refusal
		switch {
		case a.Tenant:
			return problem(http.StatusUnauthorized, "", "the caller could not be authenticated", 0, time.Time{})
		case errors.As(a.Err, &ref):
			return problem(ref.status, ref.reason, ref.detail, 0, time.Time{})
		}
	}
	if x.ran {
		return problem(http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable,
			"the idempotency store failed while recording the response; retry to learn the outcome", 0, time.Time{})
	}
	return problem(http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable,
		"the idempotency store is unavailable; the request was not processed", 0, time.Time{})
}

// problem is the status of a problem answer (WriteProblem), and how to
// send it, telling expires if it is not zero.
func problem(status int, reason, detail string, retryAfter time.Duration, expires time.Time) (int, func(http.ResponseWriter)) {
	return status, func(w http.ResponseWriter) {
		setExpires(w.Header(), expires)
		WriteProblem(w, status, reason, detail, retryAfter)
	}
}

// refusal is Fingerprint's error: a request refused before anything is
// reserved, answered with the problem it names.
type refusal struct {
	status         int
	reason, detail string
}

func (e *refusal) Error() string { return e.detail }

// request is the request the handler and the fingerprint get: r with ctx,
// and the body read for the fingerprint, if it was, to read again.
func (x *exchange) request(ctx context.Context) *http.Request {
	r := x.r.WithContext(ctx)
	if x.read {
		r = withBody(r, x.body)
	}
	return r
}

// readBody reads r's body whole, up to limit bytes. On an error, status is
// the answer: 413 past the limit, else 400.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) (body []byte, status int, err error) {
	if r.ContentLength > limit {
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, 0, nil
	}
	body, err = io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	case err != nil:
		return nil, http.StatusBadRequest, errors.New("the request body could not be read")
	}
	return body, 0, nil
}

func errTooLarge(limit int64) error {
	return fmt.Errorf("the request body is larger than the limit of %d bytes", limit)
}

// withBody is r with body to read again.
func withBody(r *http.Request, body []byte) *http.Request {
	r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	return r
}

// setExpires tells the client until when the call's key is honoured, if
// the store said: on an answer about a recorded or reserved key, never on
// one whose key was released or not reserved.
func setExpires(h http.Header, expires time.Time) {
	if !expires.IsZero() {
		h.Set(idemkey.ExpiresHeader, idemkey.FormatDate(expires))
	}
}

// Details of the 500 that takes the place of a response that cannot be
// recorded: short, so that the stand-in's record fits in store.SmallOutcome.
const (
	detailTooLarge         = "too large to record"
	detailResponseTooLarge = "the response of this request is too large to record"
	detailStoreFull        = "the store is full"
	detailUnrecordable     = "the response of this request could not be recorded"
)

// standIn is the 500 that takes the place of a response that cannot be
// recorded (why: engine.ErrTooLarge, store.ErrFull, errResponseTooLarge, or
// why encodeResponse failed), and its record: with the header of the
// middleware before, not the handler's.
func (m *middleware) standIn(w http.ResponseWriter, why error) (*capture, []byte) {
	detail := detailUnrecordable
	switch {
	case errors.Is(why, engine.ErrTooLarge):
		detail = detailTooLarge
	case errors.Is(why, errResponseTooLarge):
		detail = detailResponseTooLarge
	case errors.Is(why, store.ErrFull):
		detail = detailStoreFull
	}
	pw := newCapture(w, store.SmallOutcome)
	WriteProblem(pw, http.StatusInternalServerError, ReasonResponseNotRecorded, detail, 0)
	outcome, err := encodeResponse(nil, pw, m.opts.replayed, nil) // idemkey's own, never redacted
	if err != nil {
		// A header field of the middleware before whose name is not UTF-8:
		// the problem alone, which always encodes.
		outcome, _ = encodeResponse(nil, pw, nil, nil)
	}
	return pw, outcome
}

// replay is the status of the recorded response a replays, and how to send
// it, marked replayed.
func (x *exchange) replay(ctx context.Context, a engine.Answer) (int, func(http.ResponseWriter)) {
	resp, err := decodeResponse(a.Outcome)
	if err != nil {
		x.m.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: recorded outcome cannot be replayed",
			slog.String("operation", x.name), slog.Any("error", err))
		return problem(http.StatusInternalServerError, "", "the recorded response of this request cannot be read", 0, time.Time{})
	}
	return int(resp.GetStatus()), func(w http.ResponseWriter) {
		setExpires(w.Header(), a.Expires)
		replayResponse(w, resp, x.m.opts.replayed)
	}
}

// statusRecorder notes the status the handler writes on Pass, for the
// metrics and the hooks, which run once it has returned. It unwraps, so
// that http.ResponseController reaches w's features.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

// written notes status as the response's, if it is the first.
func (s *statusRecorder) written(status int) {
	if s.status == 0 {
		s.status = status
	}
}

func (s *statusRecorder) WriteHeader(status int) {
	if status >= 200 {
		s.written(status)
	}
	s.ResponseWriter.WriteHeader(status)
}

func (s *statusRecorder) Write(p []byte) (int, error) {
	s.written(http.StatusOK)
	return s.ResponseWriter.Write(p)
}

func (s *statusRecorder) Flush() {
	s.written(http.StatusOK)
	_ = http.NewResponseController(s.ResponseWriter).Flush()
}

func (s *statusRecorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(s.ResponseWriter).Hijack()
	if err == nil {
		s.written(http.StatusSwitchingProtocols)
	}
	return conn, rw, err
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// nameContext carries the operation name of a covered request.
type nameContext struct {
	context.Context
	name string
}

type nameKey struct{}

func (n *nameContext) Value(key any) any {
	if key == (nameKey{}) {
		return n.name
	}
	return n.Context.Value(key)
}

// OperationName returns the operation name of the covered request whose
// context is ctx (WithOperation), for a fingerprint function or the handler;
// "" for any other context.
func OperationName(ctx context.Context) string {
	name, _ := ctx.Value(nameKey{}).(string)
	return name
}
