package idemhttp

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// KeyHandler returns a handler that tells a client what became of a key it
// sent, without its request: GET .../{key}?operation=NAME, where the key is
// the path's last segment (r.PathValue("key") when mounted with a pattern
// that names it, as "GET /v1/idempotency-keys/{key}") and NAME is the
// operation as the middleware names it (DefaultOperation: the route's
// pattern, such as "POST /v1/charges"). Give it the engine and options of
// the Middleware, so that both scope and keep keys alike: a key is scoped to
// the caller's tenant (eng's TenantFunc reads r.Context()) and to the
// operation, exactly as the requests are, so a tenant never sees another's
// keys. The Idempotency-First-Sent header, if the client kept it, tells a
// key refused as expired from one never seen.
//
// A completed key is answered with its recorded response, replayed exactly
// as a retry of it gets it: status, replayed headers, body,
// Idempotent-Replayed: true and Idempotency-Key-Expires. Any other state is
// 200 application/json:
//
//	{"state": "unknown" | "in_progress" | "expired", "retry_after": 1,
//	 "steps_done": ["charge"], "expires": "Sun, 06 Dec 2026 12:00:00 GMT"}
//
// unknown: no record (never seen, released, or expired and gone): a retry
// runs. in_progress: a request holds the key; retry_after is the wait in
// whole seconds (0 once the lease has ended, when a retry takes the key
// over), also sent as Retry-After. expired: first sent longer ago than the
// retention, and no record: a retry is refused (412). steps_done names the
// key's finished steps; expires, until when the key is honoured, when the
// store can tell.
//
// Errors are RFC 9457 problems, as the middleware writes them: 400 for a
// missing or uncovered operation (a name whose method WithMethods does not
// cover), a malformed key or first-sent time; 401 when the TenantFunc
// refuses the caller; 405 for a method other than GET or HEAD; 501 for a
// store that is not a store.Looker; 503 when the store fails.
//
// It returns an error for a mistake to catch at start-up, as Middleware does.
func KeyHandler(eng *engine.Engine, opts ...Option) (http.Handler, error) {
	if eng == nil {
		return nil, errors.New("idemhttp: KeyHandler needs an engine: engine.New(store, engine.WithTenant(...))")
	}
	o := newOptions(opts)
	if o.err != nil {
		return nil, o.err
	}
	if _, err := eng.Operation(engine.OperationSpec{Retention: o.retention}); err != nil {
		return nil, err
	}
	return &keyHandler{eng: eng, opts: o}, nil
}

type keyHandler struct {
	eng  *engine.Engine
	opts *options
}

// keyState is the JSON body of a key that has no recorded response.
type keyState struct {
	State      string   `json:"state"`
	RetryAfter int64    `json:"retry_after"`
	StepsDone  []string `json:"steps_done"`
	Expires    string   `json:"expires,omitempty"`
}

// maxOperationName bounds the operation a client names.
const maxOperationName = 1024

func (k *keyHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		WriteProblem(w, http.StatusMethodNotAllowed, "", "ask for a key's state with GET", 0)
		return
	}
	key := r.PathValue("key")
	if key == "" {
		var err error
		if key, err = url.PathUnescape(path.Base(r.URL.EscapedPath())); err != nil {
			WriteProblem(w, http.StatusBadRequest, idemkey.ReasonKeyInvalid, "idempotency key malformed: its path segment is not URL-escaped text", 0)
			return
		}
	}
	name := r.URL.Query().Get("operation")
	if !k.covers(name) {
		WriteProblem(w, http.StatusBadRequest, "",
			"the operation query parameter must name an operation that idempotency keys are kept for, as the middleware names it, such as \"POST /v1/charges\"", 0)
		return
	}
	op, err := k.eng.Operation(engine.OperationSpec{Name: name, Retention: k.opts.retention})
	if err != nil { // KeyHandler checked the engine serves it
		WriteProblem(w, http.StatusInternalServerError, "", "", 0)
		return
	}
	ks, err := k.eng.Lookup(r.Context(), op, key, r.Header.Values(idemkey.FirstSentHeader), r.Header.Values(idemkey.FirstRegionHeader)...)
	if err != nil {
		k.refuse(w, err)
		return
	}
	if ks.State == engine.KeyCompleted {
		resp, err := decodeRecord(ks.Outcome)
		if err != nil {
			k.eng.Logger().LogAttrs(r.Context(), slog.LevelError, "idemkey: recorded outcome cannot be replayed",
				slog.String("operation", name), slog.Any("error", err))
			WriteProblem(w, http.StatusInternalServerError, "", "the recorded response of this request cannot be read", 0)
			return
		}
		(&replayAnswer{resp: resp, expires: ks.Expires, opts: k.opts}).send(w)
		return
	}
	body := keyState{State: ks.State.String(), StepsDone: ks.StepsDone}
	if body.StepsDone == nil {
		body.StepsDone = []string{}
	}
	h := w.Header()
	if !ks.Expires.IsZero() {
		body.Expires = idemkey.FormatDate(ks.Expires)
		setExpires(h, ks.Expires)
	}
	if ks.State == engine.KeyInProgress && ks.RetryAfter > 0 {
		body.RetryAfter = retryAfterSeconds(ks.RetryAfter)
		h.Set("Retry-After", strconv.FormatInt(body.RetryAfter, 10))
	}
	b, _ := json.Marshal(body) // strings and a number: never fails
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}

// covers reports whether name may be an operation whose keys are kept: not
// empty nor too long, and, if it starts with a method as DefaultOperation's
// names do, a method WithMethods covers.
func (k *keyHandler) covers(name string) bool {
	if name == "" || len(name) > maxOperationName {
		return false
	}
	method, _, _ := strings.Cut(name, " ")
	if isMethod(method) {
		return k.opts.methods[method]
	}
	return true
}

// isMethod reports whether s is one of the methods of RFC 9110.
func isMethod(s string) bool {
	switch s {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// refuse answers engine.Lookup's error as the middleware answers a request's.
func (k *keyHandler) refuse(w http.ResponseWriter, err error) {
	var (
		keyErr *idemkey.KeyError
		fsErr  *engine.FirstSentError
	)
	switch {
	case errors.As(err, &keyErr):
		WriteProblem(w, http.StatusBadRequest, idemkey.ReasonKeyInvalid, keyErr.Error(), 0) // never quotes the key
	case errors.As(err, &fsErr):
		WriteProblem(w, http.StatusBadRequest, idemkey.ReasonFirstSentInvalid, fsErr.Error(), 0)
	case errors.Is(err, errors.ErrUnsupported):
		WriteProblem(w, http.StatusNotImplemented, "", "this server's idempotency store cannot look keys up", 0)
	case errors.Is(err, store.ErrUnavailable), errors.Is(err, store.ErrDataLost):
		WriteProblem(w, http.StatusServiceUnavailable, idemkey.ReasonStoreUnavailable, "the idempotency store is unavailable", 0)
	default:
		WriteProblem(w, http.StatusUnauthorized, "", "the caller could not be authenticated", 0)
	}
}
