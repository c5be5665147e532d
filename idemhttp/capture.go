package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/idemkey/idemkey"
)

var errResponseTooLarge = errors.New("idemhttp: the response is too large to record; it will be replaced by a 500")

// capture buffers the whole response of an acquired key's handler, so that
// the first caller gets exactly what is recorded. It has no Unwrap method on
// purpose: http.ResponseController would write around the record.
type capture struct {
	w      http.ResponseWriter // for the deadlines only
	header http.Header         // w's own, if into (resetInto), else a copy of it
	into   bool                // header is w's: undo takes the handler's fields out
	before http.Header         // with into, what w's header held before; nil if nothing
	status int                 // 0 until WriteHeader or Write
	body   bytes.Buffer
	limit  int
	tooBig bool
}

func newCapture(w http.ResponseWriter, limit int) *capture {
	c := new(capture)
	c.reset(w, limit)
	return c
}

func (c *capture) reset(w http.ResponseWriter, limit int) {
	h := w.Header().Clone()
	if h == nil {
		h = http.Header{}
	}
	*c = capture{w: w, header: h, limit: limit}
}

// resetInto makes c a capture whose header fields are written into w's own
// header, where a response sent whole finds them (send); undo takes them
// out again for any other answer. It saves a copy of the fields one way
// and the other: all but the middleware's before it, which before keeps.
func (c *capture) resetInto(w http.ResponseWriter, limit int) {
	h := w.Header()
	if h == nil {
		c.reset(w, limit)
		return
	}
	var before http.Header
	if len(h) > 0 {
		before = h.Clone()
	}
	*c = capture{w: w, header: h, into: true, before: before, limit: limit}
}

// undo restores w's header fields as they were before the handler, for an
// answer other than c's response.
func (c *capture) undo() {
	if c.into {
		clear(c.header)
		maps.Copy(c.header, c.before)
		c.into = false
	}
}

func (c *capture) Header() http.Header { return c.header }

// WriteHeader keeps the first final status; 1xx ones are dropped, since a
// replay could not repeat them.
func (c *capture) WriteHeader(status int) {
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status)) // as net/http does
	}
	if c.status != 0 || status < 200 {
		return
	}
	c.status = status
}

func (c *capture) Write(p []byte) (int, error) {
	if err := c.admit(len(p)); err != nil {
		return 0, err
	}
	return c.body.Write(p)
}

// WriteString saves io.WriteString a copy of s.
func (c *capture) WriteString(s string) (int, error) {
	if err := c.admit(len(s)); err != nil {
		return 0, err
	}
	return c.body.WriteString(s)
}

// admit refuses a write to a status without a body, or past the bound.
func (c *capture) admit(n int) error {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if !bodyAllowed(c.status) {
		return http.ErrBodyNotAllowed
	}
	if c.tooBig || c.body.Len()+n > c.limit {
		c.tooBig = true
		return errResponseTooLarge
	}
	return nil
}

// Flush does nothing: the response is sent whole once recorded.
func (c *capture) Flush() {}

// SetReadDeadline and SetWriteDeadline serve http.ResponseController.
func (c *capture) SetReadDeadline(t time.Time) error {
	return http.NewResponseController(c.w).SetReadDeadline(t)
}

func (c *capture) SetWriteDeadline(t time.Time) error {
	return http.NewResponseController(c.w).SetWriteDeadline(t)
}

// finish applies net/http's defaults: status 200, a sniffed Content-Type.
func (c *capture) finish() {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	if _, ok := c.header["Content-Type"]; !ok && c.body.Len() > 0 && bodyAllowed(c.status) && c.header.Get("Transfer-Encoding") == "" {
		c.header.Set("Content-Type", http.DetectContentType(c.body.Bytes()))
	}
}

func (c *capture) send(w http.ResponseWriter) {
	if !c.into {
		h := w.Header()
		for k := range h {
			if _, ok := c.header[k]; !ok {
				delete(h, k)
			}
		}
		maps.Copy(h, c.header)
	}
	w.WriteHeader(c.status)
	if c.body.Len() > 0 {
		_, _ = w.Write(c.body.Bytes())
	}
}

func bodyAllowed(status int) bool {
	return (status < 100 || status > 199) && status != http.StatusNoContent && status != http.StatusNotModified
}

// encodeResponse is the record of a captured response: its status, the
// replay list's header fields and its body, redacted.
func encodeResponse(r *http.Request, c *capture, o *options, redact RedactFunc) ([]byte, error) {
	status, header, body := c.status, c.header, c.body.Bytes()
	if redact != nil {
		reply, err := redacted(r, c, o.replayed, redact)
		if err != nil {
			return nil, err
		}
		status, header, body = reply.Status, reply.Header, reply.Body
	}
	return encodeRecord(status, header, body, o.replayList)
}

// redacted is what redact leaves of a copy of the response. A panic in
// redact is an error naming only the value's type (the value may quote the
// response): the handler has run, so its key is not released.
func redacted(r *http.Request, c *capture, replayed map[string]bool, redact RedactFunc) (reply *Reply, err error) {
	reply = &Reply{Status: c.status, Header: http.Header{}, Body: bytes.Clone(c.body.Bytes())}
	for k, vs := range c.header {
		if replayed[k] {
			reply.Header[k] = slices.Clone(vs)
		}
	}
	defer func() {
		if p := recover(); p != nil {
			reply, err = nil, fmt.Errorf("the redaction function panicked with a value of type %T (its words are not logged: they may quote the response)", p)
		}
	}()
	redact(r, reply)
	if reply.Status < 200 || reply.Status > 999 {
		return nil, fmt.Errorf("the redaction function left the status %d, not a final status", reply.Status)
	}
	if !bodyAllowed(reply.Status) {
		reply.Body = nil
	}
	for k, vs := range reply.Header { // canonical, as the replay list
		if c := http.CanonicalHeaderKey(k); c != k {
			delete(reply.Header, k)
			reply.Header[c] = append(reply.Header[c], vs...)
		}
	}
	return reply, nil
}

// replayResponse writes a recorded response with today's replay list.
func replayResponse(w http.ResponseWriter, resp *recordedResponse, o *options) {
	h := w.Header()
	// The values share one string and one slice, each field's capped so
	// that an append to one never writes over the next.
	n, size := 0, 0
	resp.eachHeader(func(_, entry []byte) {
		eachValue(entry, func(v []byte) { n, size = n+1, size+len(v) })
	})
	var text strings.Builder
	text.Grow(size)
	values := make([]string, 0, n)
	resp.eachHeader(func(key, entry []byte) {
		k, ok := o.replayedWire[string(key)]
		if !ok { // a name not in lower case, which no record of the middleware's holds
			if k = http.CanonicalHeaderKey(string(key)); !o.replayed[k] {
				return
			}
		}
		start := len(values)
		eachValue(entry, func(v []byte) {
			from := text.Len()
			text.Write(v)
			values = append(values, text.String()[from:])
		})
		h[k] = values[start:len(values):len(values)]
	})
	h[idemkey.ReplayedHeader] = replayedValue
	w.WriteHeader(resp.status)
	if len(resp.body) > 0 && bodyAllowed(resp.status) {
		_, _ = w.Write(resp.body)
	}
}
