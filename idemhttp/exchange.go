package idemhttp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// exchange is one covered request, as engine.Serve reads and answers it.
// Answer prepares the middleware's own answers, sent only after Serve has run
// the hooks, so that a client that has the answer knows they have returned;
// a response the handler writes itself (Pass) goes out before them. What
// the handler is handed lives apart, in its loan, so that the exchange is
// reused once the request is answered (exchanges), as a replay's is.
type exchange struct {
	m    *middleware
	r    *http.Request
	w    http.ResponseWriter
	next http.Handler
	name string

	body    []byte       // the request body, read for the fingerprint
	read    bool         // body was read: the handler gets it, not r.Body
	buf     *[]byte      // from bodyBuffers, which body's array returns to if not lent
	lent    bool         // request gave body out: it is not returned
	loan    *loan        // what request handed out, if it was called
	ran     bool         // the handler ran (Run)
	cw      *capture     // the handler's buffered response, for Run: &loan.captured
	standIn *capture     // the 500 recorded in its place, if it could not be
	send    sender       // the answer Answer prepared
	keyed   bool         // Key found one: Pass runs it unprotected (FailedOpen)
	replay  replayAnswer // the replay that send is, if Answer prepared one
}

// loan is what an exchange hands the handler, or a FingerprintFunc, which
// may keep it past the request: never reused.
type loan struct {
	body     bodyReader     // reads the body again, after the fingerprint
	rec      statusRecorder // the handler's writes, for Pass
	captured capture        // the handler's buffered response, for Run
}

// exchanges holds exchanges for requests to come: nothing of one is handed
// out but its loan, and Serve, its hooks included, returns before the
// middleware sends its answer.
var exchanges = sync.Pool{New: func() any { return new(exchange) }}

// sender sends an answer Answer prepared: a captured response, a replay, or
// a problem.
type sender interface{ send(w http.ResponseWriter) }

type sendFunc func(w http.ResponseWriter)

func (f sendFunc) send(w http.ResponseWriter) { f(w) }

func (x *exchange) Key() (string, bool, error) {
	key, ok, err := KeyFromHeader(x.r.Header)
	x.keyed = ok
	return key, ok, err
}

func (x *exchange) FirstSent() []string { return x.r.Header[idemkey.FirstSentHeader] }

func (x *exchange) FirstRegion() []string { return x.r.Header[idemkey.FirstRegionHeader] }

// Attempt is the zero Attempt: HTTP does not say which attempt a request is.
func (x *exchange) Attempt() engine.Attempt { return engine.Attempt{} }

// Fingerprint reads the body whole, up to WithMaxBodySize. Its error is a
// *refusal, which Answer writes as its problem.
func (x *exchange) Fingerprint(ctx context.Context) (store.Fingerprint, error) {
	var buf []byte
	if x.m.opts.fingerprint == nil { // a FingerprintFunc gets body itself: never a used buffer
		x.buf = bodyBuffers.Get().(*[]byte)
		buf = *x.buf
	}
	body, status, err := readBody(x.r, x.m.opts.maxBody, buf)
	if err != nil {
		reason := ReasonRequestUnreadable
		if status == http.StatusRequestEntityTooLarge {
			reason = ReasonRequestTooLarge
		}
		return store.Fingerprint{}, &refusal{status: status, reason: reason, detail: err.Error()}
	}
	x.body, x.read = body, true
	if x.m.opts.fingerprint == nil {
		return fingerprint(x.r, x.name, body), nil // of r itself: no copy
	}
	fp, err := x.m.opts.fingerprint(x.request(ctx), body)
	if err != nil {
		// The FingerprintFunc's own words may quote the request.
		x.m.eng.Logger().LogAttrs(ctx, slog.LevelWarn, "idemkey: fingerprint refused the request", slog.String("operation", x.name),
			slog.String("error", fmt.Sprintf("an error of type %T (its words are not logged: they may quote the request)", err)))
		return store.Fingerprint{}, &refusal{status: http.StatusBadRequest, reason: ReasonRequestUnreadable, detail: "the request could not be fingerprinted"}
	}
	return fp, nil
}

// Run runs the handler into a buffer. In atomic mode only a status below 400
// keeps the handler's writes.
func (x *exchange) Run(ctx context.Context) engine.HandlerResult {
	x.ran = true
	o := x.m.opts
	r := x.request(ctx)
	x.cw = &x.loan.captured
	x.cw.resetInto(x.w, x.m.eng.MaxRecordSize())
	x.next.ServeHTTP(x.cw, r)
	x.cw.finish()
	switch {
	case x.cw.tooBig:
		return engine.HandlerResult{Unrecordable: errResponseTooLarge}
	case !o.recorded(x.cw.status):
		return engine.HandlerResult{Release: true}
	}
	outcome, err := encodeResponse(r, x.cw, o, o.redact)
	return engine.HandlerResult{Record: outcome, KeepWrites: x.cw.status < 400, Unrecordable: err}
}

func (x *exchange) StandIn(why error) []byte {
	if x.cw != nil {
		x.cw.undo() // the stand-in has the header of the middleware before
	}
	pw, outcome := x.m.standIn(x.w, why)
	x.standIn = pw
	return outcome
}

func (x *exchange) Pass(ctx context.Context) int {
	if x.keyed {
		x.w.Header()[idemkey.StatusHeader] = ignoredValue
	}
	r := x.request(ctx)
	x.loan.rec = statusRecorder{ResponseWriter: x.w}
	x.next.ServeHTTP(&x.loan.rec, r)
	if x.loan.rec.status == 0 {
		return http.StatusOK
	}
	return x.loan.rec.status
}

func (x *exchange) Answer(ctx context.Context, a engine.Answer) int {
	status, send := x.answer(ctx, a)
	if x.cw != nil && send != x.cw {
		x.cw.undo() // the handler's header fields go out only with its response
	}
	x.send = send
	return status
}

func (x *exchange) answer(ctx context.Context, a engine.Answer) (int, sender) {
	switch a.Verdict {
	case engine.Executed:
		cw := x.cw
		if a.StandIn != nil {
			cw = x.standIn // StandIn made it
		}
		setExpires(cw.header, a.Expires) // after its record: the expiry is each answer's own
		cw.header[idemkey.ReplayedHeader] = firstValue
		return cw.status, cw
	case engine.Replayed:
		return x.replayed(ctx, a)
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
	case engine.OutcomeUnknown:
		return problem(http.StatusInternalServerError, idemkey.ReasonOutcomeUnknown,
			"a step that an earlier request with this Idempotency-Key started never finished, and its outcome is unknown; "+
				"the request was not completed, and is answered so until the step is reconciled or an operator resolves it", 0, time.Time{})
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

func problem(status int, reason, detail string, retryAfter time.Duration, expires time.Time) (int, sender) {
	return status, sendFunc(func(w http.ResponseWriter) {
		setExpires(w.Header(), expires)
		WriteProblem(w, status, reason, detail, retryAfter)
	})
}

// refusal is Fingerprint's error, answered with the problem it names.
type refusal struct {
	status         int
	reason, detail string
}

func (e *refusal) Error() string { return e.detail }

// request is r with ctx and the body read for the fingerprint, to read
// again. Only one such request may read its body at a time.
func (x *exchange) request(ctx context.Context) *http.Request {
	if x.loan == nil {
		x.loan = new(loan)
	}
	r := x.r.WithContext(ctx)
	if x.read {
		x.lent = true
		x.loan.body.Reset(x.body)
		r.Body, r.ContentLength = &x.loan.body, int64(len(x.body))
	}
	return r
}

// bodyBuffers holds body buffers of past requests whose body only the
// fingerprint read, as on a replay; a pointer whose slice is nil otherwise.
var bodyBuffers = sync.Pool{New: func() any { return new([]byte) }}

// release returns the body's buffer to bodyBuffers, unless it was lent.
func (x *exchange) release() {
	if x.buf == nil {
		return
	}
	*x.buf = nil
	if !x.lent && cap(x.body) <= preallocMax+1 {
		*x.buf = x.body[:0]
	}
	bodyBuffers.Put(x.buf)
	x.buf, x.body = nil, nil
}

type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

// readBody reads r's body whole, up to limit bytes; on an error, status is
// 413 past the limit, else 400.
func readBody(r *http.Request, limit int64, buf []byte) (body []byte, status int, err error) {
	if r.ContentLength > limit {
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, 0, nil
	}
	body, tooLarge, err := readAll(r.Body, r.ContentLength, limit, buf)
	switch {
	case tooLarge:
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	case err != nil:
		return nil, http.StatusBadRequest, errors.New("the request body could not be read")
	}
	return body, 0, nil
}

// readAll is io.ReadAll up to limit bytes (tooLarge past it). A body of size
// bytes is read into a buffer of size+1, rather than grown; but no more than
// preallocMax before the bytes arrive, since size is the client's word: a
// flood of requests that claim a large Content-Length and send nothing costs
// no more than one that sends its bytes. buf is used if it has the room.
func readAll(r io.Reader, size, limit int64, buf []byte) (b []byte, tooLarge bool, err error) {
	if size < 0 {
		size = 511
	}
	if n := min(size, limit, preallocMax) + 1; int64(cap(buf)) >= n {
		b = buf[:0]
	} else {
		b = make([]byte, 0, n)
	}
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // room for more, as io.ReadAll makes it
		}
		n, err := r.Read(b[len(b):min(cap(b), readEnd(limit))])
		b = b[:len(b)+n]
		switch {
		case int64(len(b)) > limit:
			return nil, true, nil
		case err == io.EOF:
			return b, false, nil
		case err != nil:
			return nil, false, err
		}
	}
}

// readEnd is limit+1, to see a body pass it, without overflow at
// math.MaxInt64, "no limit".
func readEnd(limit int64) int {
	if limit >= math.MaxInt-1 {
		return math.MaxInt
	}
	return int(limit) + 1
}

const preallocMax = 64 << 10

func errTooLarge(limit int64) error {
	return fmt.Errorf("the request body is larger than the limit of %d bytes", limit)
}

// The fates' header values, never modified.
var (
	firstValue    = []string{"false"}
	replayedValue = []string{"true"}
	ignoredValue  = []string{idemkey.StatusIgnored}
)

func setExpires(h http.Header, expires time.Time) {
	if !expires.IsZero() {
		h[idemkey.ExpiresHeader] = expiryValue(expires)
	}
}

// expiryValues keeps the last minute's expiry header values, one per
// second, made once a second rather than once an answer; never modified.
var expiryValues [64]atomic.Pointer[expiry]

type expiry struct {
	unix  int64
	value []string
}

func expiryValue(t time.Time) []string {
	unix := t.Unix()
	kept := &expiryValues[uint64(unix)%uint64(len(expiryValues))]
	if e := kept.Load(); e != nil && e.unix == unix {
		return e.value
	}
	e := &expiry{unix, []string{idemkey.FormatDate(t)}}
	kept.Store(e)
	return e.value
}

// Details of the 500 that takes the place of a response that cannot be
// recorded: short, so that the stand-in's record fits in store.SmallOutcome.
const (
	detailTooLarge         = "too large to record"
	detailResponseTooLarge = "the response of this request is too large to record"
	detailStoreFull        = "the store is full"
	detailUnrecordable     = "the response of this request could not be recorded"
)

// standIn is the 500, and its record, in place of a response that cannot be
// recorded: with the header of the middleware before, not the handler's.
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
	outcome, err := encodeResponse(nil, pw, m.opts, nil) // idemkey's own, never redacted
	if err != nil {
		// A header field of the middleware before whose name is not UTF-8:
		// the problem alone, which always encodes.
		outcome, _ = encodeRecord(pw.status, nil, pw.body.Bytes(), nil)
	}
	return pw, outcome
}

func (x *exchange) replayed(ctx context.Context, a engine.Answer) (int, sender) {
	resp, err := decodeRecord(a.Outcome)
	if err != nil {
		x.m.eng.Logger().LogAttrs(ctx, slog.LevelError, "idemkey: recorded outcome cannot be replayed",
			slog.String("operation", x.name), slog.Any("error", err))
		return problem(http.StatusInternalServerError, "", "the recorded response of this request cannot be read", 0, time.Time{})
	}
	x.replay = replayAnswer{resp: resp, expires: a.Expires, opts: x.m.opts}
	return resp.status, &x.replay
}

type replayAnswer struct {
	resp    recordedResponse
	expires time.Time
	opts    *options
}

func (r *replayAnswer) send(w http.ResponseWriter) {
	setExpires(w.Header(), r.expires)
	replayResponse(w, &r.resp, r.opts)
}
