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

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Middleware returns net/http middleware that runs each covered request at
// most once per idempotency key on st and replays its recorded response to
// every retry. Among opts are the settings every entry point shares: the
// tenant (its TenantFunc reads r.Context(), where an authentication
// middleware put the caller's identity), whether a key is required, leases,
// retention, metrics. See the package documentation for what is covered and
// answered.
//
// It returns an error for a mistake to catch at start-up: WithAtomic on a
// store that does not implement store.Atomic, or a header WithReplayedHeaders
// may not replay.
func Middleware(st store.Store, opts ...Option) (func(http.Handler) http.Handler, error) {
	if st == nil {
		return nil, errors.New("idemhttp: Middleware needs a store")
	}
	o := newOptions(opts)
	if o.err != nil {
		return nil, o.err
	}
	eng := engine.New(st, o.engine...)
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
		panic(err) // Middleware checked that the store serves this mode
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

// HashRequest is the default fingerprint (WithFingerprint): the SHA-256 of
// "idemhttp v1", the method, the operation name, the escaped path, the raw
// query, the media type of the Content-Type in lower case (without its
// parameters) and the body, each with its length in front
// (store.AppendParts). Two requests that differ in any of them differ; so do
// one sent to an HTTP route and one to a gRPC method, whatever their names.
func HashRequest(r *http.Request, body []byte) (store.Fingerprint, error) {
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
	rec := &statusRecorder{ResponseWriter: w, call: m.eng.Call(op), ctx: r.Context()} // one allocation for both
	c := &rec.call
	if !kept {
		m.warnOnce.Do(func() {
			c.Log(r.Context(), slog.LevelWarn, "more than 1024 operation names: operations are no longer kept; WithOperation should name routes, never paths", nil)
		})
	}
	m.handle(rec, r, name, next, c)
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	rec.end()
}

// handle is serve for a covered request; it sets c.Verdict to what became of
// the call.
func (m *middleware) handle(w *statusRecorder, r *http.Request, name string, next http.Handler, c *engine.Call) {
	ctx := r.Context()
	key, ok, err := KeyFromHeader(r.Header)
	if err != nil {
		c.Verdict = engine.KeyInvalid
		WriteProblem(w, http.StatusBadRequest, idemkey.ReasonKeyInvalid, err.Error(), 0)
		return
	}
	if !ok {
		if m.eng.KeyRequired() {
			c.Verdict = engine.KeyMissing
			WriteProblem(w, http.StatusBadRequest, idemkey.ReasonKeyMissing, "this operation requires an Idempotency-Key header", 0)
			return
		}
		c.Verdict = engine.NoKey
		w.handlerWrites = true
		next.ServeHTTP(w, r)
		return
	}
	firstSent, err := m.eng.FirstSent(r.Header.Values(idemkey.FirstSentHeader))
	if err != nil {
		c.Verdict = engine.FirstSentInvalid
		WriteProblem(w, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid, err.Error(), 0)
		return
	}
	tenant, err := m.eng.Tenant(ctx)
	if err != nil {
		WriteProblem(w, http.StatusUnauthorized, "", "the caller could not be authenticated", 0)
		return
	}
	body, status, err := readBody(w, r, m.opts.maxBody)
	if err != nil {
		reason := ReasonRequestUnreadable
		if status == http.StatusRequestEntityTooLarge {
			reason = ReasonRequestTooLarge
		}
		WriteProblem(w, status, reason, err.Error(), 0)
		return
	}
	r = withBody(r.WithContext(&nameContext{ctx, name}), body) // for a fingerprint that reads it
	fp, err := m.opts.fingerprint(r, body)
	if err != nil {
		c.Log(ctx, slog.LevelWarn, "fingerprint refused the request", err)
		WriteProblem(w, http.StatusBadRequest, ReasonRequestUnreadable, "the request could not be fingerprinted", 0)
		return
	}

	c.Start(ctx, engine.Request{Tenant: tenant, Key: key, Fingerprint: fp, FirstSent: firstSent})
	switch c.Verdict {
	case engine.Executed:
		m.run(w, r, body, next, c)
	case engine.FailedOpen:
		w.handlerWrites = true
		next.ServeHTTP(w, withBody(r.WithContext(c.Context(r.Context())), body))
	default:
		m.answer(w, r, c)
	}
}

// answer answers a request that did not run the handler, as c.Verdict says.
func (m *middleware) answer(w http.ResponseWriter, r *http.Request, c *engine.Call) {
	switch c.Verdict {
	case engine.Replayed:
		m.replay(w, r, c)
	case engine.InProgress:
		setExpires(w.Header(), c)
		WriteProblem(w, http.StatusConflict, idemkey.ReasonInProgress,
			"a request with this Idempotency-Key is being processed; retry after the time given", c.RetryAfter)
	case engine.Reused:
		setExpires(w.Header(), c)
		WriteProblem(w, http.StatusUnprocessableEntity, idemkey.ReasonKeyReused,
			"this Idempotency-Key was first used with another request", 0)
	case engine.Expired:
		WriteProblem(w, http.StatusPreconditionFailed, idemkey.ReasonKeyExpired,
			"the operation of this Idempotency-Key was first sent longer ago than keys are kept, and has no record; it was not run", 0)
	case engine.FirstSentInvalid: // Start's own check, which the one before it makes unlikely
		WriteProblem(w, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid,
			"the Idempotency-First-Sent time lies in the future, beyond the clock skew allowed", 0)
	case engine.StoreFull:
		WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreFull,
			"the idempotency store has no room for a new key; retry later", c.RetryAfter)
	default:
		WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable,
			"the idempotency store is unavailable; the request was not processed", 0)
	}
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

// run runs the handler for an acquired key, then records its response or
// releases the key, and answers. The handler's response is buffered
// (capture) and sent only once recorded: the first caller gets what every
// retry will. In atomic mode only a status below 400 keeps the handler's
// writes.
func (m *middleware) run(w http.ResponseWriter, r *http.Request, body []byte, next http.Handler, c *engine.Call) {
	ctx := r.Context()
	cw := newCapture(w, m.eng.MaxRecordSize())
	defer c.Abandon(ctx) // the handler panicked: let a retry run again
	next.ServeHTTP(cw, withBody(r.WithContext(c.Context(ctx)), body))
	cw.finish()

	if cw.tooBig {
		c.Log(ctx, slog.LevelError, "response cannot be recorded; a 500 is recorded instead", errResponseTooLarge)
		m.recordInstead(w, r, c, "the response of this request is too large to record")
		return
	}
	if !m.opts.recorded(cw.status) {
		c.Release(ctx)
		cw.send(w)
		return
	}
	outcome, err := encodeResponse(r, cw, m.opts.replayed, m.opts.redact)
	if err != nil {
		c.Log(ctx, slog.LevelError, "response cannot be recorded; a 500 is recorded instead", err)
		m.recordInstead(w, r, c, "the response of this request could not be recorded")
		return
	}
	switch err := c.Record(ctx, outcome, cw.status < 400); {
	case errors.Is(err, engine.ErrTooLarge):
		m.recordInstead(w, r, c, detailTooLarge)
	case errors.Is(err, store.ErrFull):
		m.recordInstead(w, r, c, detailStoreFull)
	case errors.Is(err, engine.ErrSuperseded):
		m.answer(w, r, c)
	case err != nil:
		WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable,
			"the idempotency store failed while recording the response; retry to learn the outcome", 0)
	default:
		setExpires(cw.header, c) // after its record: the expiry is each answer's own
		cw.send(w)
	}
}

// setExpires tells the client until when the call's key is honoured, if
// the store said: on an answer about a recorded or reserved key, never on
// one whose key was released or not reserved.
func setExpires(h http.Header, c *engine.Call) {
	if !c.Expires.IsZero() {
		h.Set(idemkey.ExpiresHeader, idemkey.FormatDate(c.Expires))
	}
}

// Details of the 500 that takes the place of a response that cannot be
// recorded: short, so that the stand-in's record fits in store.SmallOutcome.
const (
	detailTooLarge  = "too large to record"
	detailStoreFull = "the store is full"
)

// recordInstead records a short 500 in place of a response that cannot be
// recorded: the handler has run, so its key must not be released. The caller
// gets it too, as every retry will; if even it cannot be recorded, the key
// stays in progress until its lease ends. Only in atomic mode, where a
// failed commit undoes the handler's writes, is the answer a 503.
func (m *middleware) recordInstead(w http.ResponseWriter, r *http.Request, c *engine.Call, detail string) {
	pw, outcome, err := m.standIn(w, detail)
	if err == nil {
		err = c.Record(r.Context(), outcome, false)
	}
	if errors.Is(err, engine.ErrSuperseded) {
		m.answer(w, r, c)
		return
	}
	if err != nil && c.Atomic() {
		WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable,
			"the idempotency store failed while recording the response; retry to learn the outcome", 0)
		return
	}
	if err == nil {
		setExpires(pw.header, c)
	}
	pw.send(w)
}

// standIn is the 500 that takes the place of a response that cannot be
// recorded, and its record: with the header of the middleware before, not
// the handler's.
func (m *middleware) standIn(w http.ResponseWriter, detail string) (*capture, []byte, error) {
	pw := newCapture(w, store.SmallOutcome)
	WriteProblem(pw, http.StatusInternalServerError, ReasonResponseNotRecorded, detail, 0)
	outcome, err := encodeResponse(nil, pw, m.opts.replayed, nil) // idemkey's own, never redacted
	return pw, outcome, err
}

// replay answers a retry with the recorded response.
func (m *middleware) replay(w http.ResponseWriter, r *http.Request, c *engine.Call) {
	resp, err := decodeResponse(c.Outcome)
	if err != nil {
		c.Log(r.Context(), slog.LevelError, "recorded outcome cannot be replayed", err)
		WriteProblem(w, http.StatusInternalServerError, "", "the recorded response of this request cannot be read", 0)
		return
	}
	setExpires(w.Header(), c)
	replayResponse(w, resp, m.opts.replayed)
}

// statusRecorder notes the status written, for the metrics, and ends the
// call: as the middleware's own answer writes its status, before the status
// goes out, so that the hooks run before the client has the answer; or,
// when the handler writes the response (handlerWrites), once it has
// returned. It unwraps, so that http.ResponseController reaches w's
// features.
type statusRecorder struct {
	http.ResponseWriter
	status int

	call          engine.Call
	ctx           context.Context
	ended         bool
	handlerWrites bool // the handler answers: end the call after it
}

// written notes status as the response's, and ends the call before it goes
// out if the middleware answers.
func (s *statusRecorder) written(status int) {
	if s.status != 0 {
		return
	}
	s.status = status
	if !s.handlerWrites {
		s.end()
	}
}

// end ends the call with the status written, once.
func (s *statusRecorder) end() {
	if !s.ended {
		s.ended = true
		s.call.End(s.ctx, s.status)
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
