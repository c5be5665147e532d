package idemhttp

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
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
// most once per idempotency key on eng, and replays its recorded response to
// every retry. eng's TenantFunc reads r.Context(), where authentication put
// the caller's identity.
//
// It returns an error for a mistake to catch at start-up: a nil eng, no
// tenant (engine.WithTenant or engine.WithSingleTenant), WithAtomic on a
// store that is not a store.Atomic, a header that may not be replayed, or a
// WithRetention shorter than the engine's longest lease.
func Middleware(eng *engine.Engine, opts ...Option) (func(http.Handler) http.Handler, error) {
	if eng == nil {
		return nil, errors.New("idemhttp: Middleware needs an engine: engine.New(store, engine.WithTenant(...))")
	}
	o := newOptions(opts)
	if o.err != nil {
		return nil, o.err
	}
	if _, err := eng.Operation(engine.OperationSpec{Atomic: o.atomic, Retention: o.retention}); err != nil {
		return nil, err
	}
	m := &middleware{eng: eng, opts: o}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
	}, nil
}

// middleware translates HTTP requests into the engine's request path and
// back.
type middleware struct {
	eng      *engine.Engine
	opts     *options
	ops      sync.Map // opKey -> *engine.Operation
	nops     atomic.Int64
	warnOnce sync.Once // logs once that operations are no longer kept
}

// maxOperations bounds the operations kept; past it each request builds its
// own.
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
	op, err := m.eng.Operation(engine.OperationSpec{Name: name, Atomic: m.opts.atomic, Retention: m.opts.retention,
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

// route is a ServeMux pattern's path, http.route: "/v1/charges/{id}" for
// "POST /v1/charges/{id}".
func route(pattern string) string {
	if _, rest, ok := strings.Cut(pattern, " "); ok {
		pattern = strings.TrimLeft(rest, " \t")
	}
	if i := strings.IndexByte(pattern, '/'); i >= 0 {
		return pattern[i:]
	}
	return ""
}

// DefaultOperation names a request's operation by the http.ServeMux pattern
// that matched it, such as "POST /v1/charges", else its method alone.
// r.Pattern is set only for a handler the mux calls, so wrap each handler as
// you register it; around the whole mux, a key names one request of its
// tenant across every path, as Stripe's keys do.
func DefaultOperation(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.Method
}

// DefaultFingerprint is the SHA-256 of "idemhttp v1", the method, the
// operation name, the escaped path, the raw query, the lower-case media type
// and the body, each length-prefixed (store.AppendParts): it never matches a
// gRPC method's.
func DefaultFingerprint(r *http.Request, body []byte) (store.Fingerprint, error) {
	return fingerprint(r, OperationName(r.Context()), body), nil
}

func fingerprint(r *http.Request, name string, body []byte) store.Fingerprint {
	var contentType string
	if v := r.Header["Content-Type"]; len(v) > 0 { // canonical, as Get would make it
		contentType = v[0]
	}
	// mime.ParseMediaType's result without parameters, without its map.
	mediaType := strings.ToLower(strings.TrimSpace(contentType))
	if strings.Contains(contentType, ";") {
		if mt, _, err := mime.ParseMediaType(contentType); err == nil {
			mediaType = mt
		}
	}
	h := sha256.New()
	parts := store.AppendParts(make([]byte, 0, 256), "idemhttp v1", r.Method, name,
		r.URL.EscapedPath(), r.URL.RawQuery, mediaType)
	h.Write(binary.BigEndian.AppendUint64(parts, uint64(len(body)))) // store.AppendParts, for bytes
	h.Write(body)
	var fp store.Fingerprint
	h.Sum(fp[:0])
	return fp
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	name := ""
	if m.opts.methods[r.Method] {
		name = m.opts.operation(r)
	}
	if name == "" {
		if len(r.Header[idemkey.KeyHeader]) > 0 {
			w.Header()[idemkey.StatusHeader] = ignoredValue
		}
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
	x := exchanges.Get().(*exchange)
	*x = exchange{m: m, r: r, w: w, next: next, name: name}
	m.eng.Serve(&nameContext{r.Context(), name}, op, x)
	if x.send != nil { // the middleware's own answer, once the hooks have run
		x.send.send(w)
	}
	x.release()
	*x = exchange{} // holds on to nothing of the request
	exchanges.Put(x)
}

// statusRecorder notes the status the handler writes on Pass, for the
// metrics and hooks. It unwraps, for http.ResponseController.
type statusRecorder struct {
	http.ResponseWriter
	status int
}

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
// context is ctx; "" for any other.
func OperationName(ctx context.Context) string {
	name, _ := ctx.Value(nameKey{}).(string)
	return name
}
