package idemtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemhttp"
)

// RoundTripper returns an http.RoundTripper that sends each request that
// carries an Idempotency-Key header through base (http.DefaultTransport if
// nil) under the Kit's Chaos (see Call). Requests are compared on their
// status and body, and marked replayed by Idempotent-Replayed; a 409 whose
// problem is idemkey's "in progress" is sent again after its Retry-After.
// It serves idemhttp's middleware, and Connect's protocol too, since a
// Connect call is one POST:
//
//	client := &http.Client{Transport: kit.RoundTripper(nil)}
//
// A request without a key passes through untouched. The caller gets the
// response of the last attempt, or, for a reply that Chaos.LoseReply lost,
// an error, as a lost reply looks to an HTTP client.
func (k *Kit) RoundTripper(base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return &roundTripper{k: k, base: base}
}

type roundTripper struct {
	k    *Kit
	base http.RoundTripper
}

// errLostReply is the error of a request whose response Chaos.LoseReply
// lost.
var errLostReply = errors.New("idemtest: the response was lost (Chaos.LoseReply): retry the request with its key")

func (rt *roundTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	key, ok, err := idemhttp.KeyFromHeader(req.Header)
	if !ok || err != nil { // none, or one the server refuses
		return rt.base.RoundTrip(req)
	}
	var body []byte
	if req.Body != nil {
		body, err = io.ReadAll(req.Body)
		req.Body.Close()
		if err != nil {
			return nil, err
		}
	}
	var (
		mu   sync.Mutex
		sent = make(map[int]*httpAttempt)
	)
	n, lost := rt.k.Call(req.Context(), key, func(ctx context.Context, n int) Try {
		r := req.Clone(ctx)
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		a := &httpAttempt{}
		a.resp, a.err = rt.base.RoundTrip(r)
		if a.err == nil {
			a.body, a.err = io.ReadAll(a.resp.Body)
			a.resp.Body.Close()
		}
		mu.Lock()
		sent[n] = a
		mu.Unlock()
		return a.read()
	})
	if lost {
		return nil, errLostReply
	}
	mu.Lock()
	a := sent[n]
	mu.Unlock()
	if a.err != nil {
		return nil, a.err
	}
	a.resp.Body = io.NopCloser(bytes.NewReader(a.body))
	return a.resp, nil
}

// httpAttempt is one attempt's response, its body read.
type httpAttempt struct {
	resp *http.Response
	body []byte
	err  error
}

func (a *httpAttempt) read() Try {
	if a.err != nil {
		return Try{Code: "no response", Reply: a.err.Error(), Failed: true, NoAnswer: true}
	}
	code := a.resp.StatusCode
	out := Try{
		Code:     strconv.Itoa(code),
		Failed:   code >= 400,
		Reply:    string(a.body),
		Replayed: idemkey.ParseReplayed(a.resp.Header.Values(idemkey.ReplayedHeader)),
	}
	if code >= 400 {
		out.Reason = problemReason(a.body)
	}
	if code == http.StatusConflict && out.Reason == idemkey.ReasonInProgress {
		out.InProgress = true
		if s, err := strconv.Atoi(a.resp.Header.Get("Retry-After")); err == nil {
			out.RetryAfter = time.Duration(s) * time.Second
		}
	}
	return out
}

// problemReason is idemkey's reason of an RFC 9457 problem body, or "".
func problemReason(body []byte) string {
	var p struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(body, &p) != nil {
		return ""
	}
	return idemhttp.ProblemReason(p.Type)
}
