package example

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// Processor is a card processor over HTTP, the kind of downstream service a
// step calls. It does not honour idempotency keys: every POST charges, so a
// charge made twice shows. It keeps the key a charge was made with, if
// any, so that the caller can look it up:
//
//	POST /charges           {"customer_id", "amount", "currency"}, a key in Idempotency-Key: 200 {"id"}
//	GET  /charges?idempotency_key=K   200 {"id"} of the charge made with K, or 404
//	GET  /charges/count     200 {"count"}: how many charges it has made
//
// A Processor may wait after it has charged and before it answers, so that
// a caller's crash can fall inside the call; one that hangs charges and
// then never answers: it holds each POST until the client gives up, as a
// processor whose answer is lost.
type Processor struct {
	delay time.Duration
	hang  bool

	mu    sync.Mutex
	byKey map[string]string // the id of the charge made with each key, the last if several
	count int
}

// NewProcessor returns a processor with no charges that answers a POST
// delay after it has charged or, with hang, never.
func NewProcessor(delay time.Duration, hang bool) *Processor {
	return &Processor{delay: delay, hang: hang, byKey: make(map[string]string)}
}

// processorCharge is the body of POST /charges.
type processorCharge struct {
	CustomerID string `json:"customer_id"`
	Amount     int64  `json:"amount"`
	Currency   string `json:"currency"`
}

// processorReply is the body of a charge's answer.
type processorReply struct {
	ID string `json:"id"`
}

// ServeHTTP implements http.Handler.
func (p *Processor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/charges" && r.Method == http.MethodPost:
		p.charge(w, r)
	case r.URL.Path == "/charges" && r.Method == http.MethodGet:
		p.mu.Lock()
		id, ok := p.byKey[r.URL.Query().Get("idempotency_key")]
		p.mu.Unlock()
		if !ok {
			http.Error(w, "no charge with this key", http.StatusNotFound)
			return
		}
		writeJSON(w, processorReply{ID: id})
	case r.URL.Path == "/charges/count" && r.Method == http.MethodGet:
		writeJSON(w, struct {
			Count int `json:"count"`
		}{p.Count()})
	default:
		http.NotFound(w, r)
	}
}

// Count returns how many charges p has made.
func (p *Processor) Count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.count
}

func (p *Processor) charge(w http.ResponseWriter, r *http.Request) {
	var c processorCharge
	key := r.Header.Get("Idempotency-Key")
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&c); err != nil || c.CustomerID == "" || c.Amount <= 0 || c.Currency == "" {
		http.Error(w, "a charge needs customer_id, a positive amount and currency", http.StatusBadRequest)
		return
	}
	var b [12]byte
	rand.Read(b[:])
	id := "pch_" + hex.EncodeToString(b[:])
	p.mu.Lock()
	if key != "" {
		p.byKey[key] = id
	}
	p.count++
	p.mu.Unlock()
	if p.hang {
		<-r.Context().Done()
		return
	}
	select {
	case <-time.After(p.delay):
	case <-r.Context().Done():
		return
	}
	writeJSON(w, processorReply{ID: id})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// processorClient charges a Processor at its URL, as CreateCharge's step.
type processorClient struct {
	url  string
	http *http.Client
}

// newProcessorClient returns a client of the processor at base whose calls
// take at most timeout each.
func newProcessorClient(base string, timeout time.Duration) (*processorClient, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("example: the processor's URL %q is not an http(s) URL", base)
	}
	return &processorClient{url: u.JoinPath("charges").String(), http: &http.Client{Timeout: timeout}}, nil
}

// errProcessor is a processor's answer that the client does not expect.
var errProcessor = errors.New("example: the card processor answered")

// charge charges c's customer at the processor under the step's derived key
// (ctx's client key; none outside a call that holds a key, as in a server
// without idempotency), and returns the processor's id of the charge. A POST
// that failed before it could have charged, one that found no connection or
// that the processor refused as a bad request, is engine.NotDone; a timeout
// or a lost answer is not: the processor may have charged. The POST is not
// cut short by a client that hangs up, which would leave its outcome
// unknown; the client's timeout bounds it.
func (p *processorClient) charge(ctx context.Context, c *paymentsv1.Charge) (string, error) {
	key, _, _ := idemkey.KeyFromContext(ctx)
	body, _ := json.Marshal(processorCharge{CustomerID: c.GetCustomerId(), Amount: c.GetAmount(), Currency: c.GetCurrency()})
	req, err := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodPost, p.url, bytes.NewReader(body))
	if err != nil {
		return "", engine.NotDone(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := p.http.Do(req)
	if err != nil {
		if opErr := new(net.OpError); errors.As(err, &opErr) && opErr.Op == "dial" {
			return "", engine.NotDone(err)
		}
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 400 && resp.StatusCode < 500 {
		return "", engine.NotDone(fmt.Errorf("%w %s to a charge", errProcessor, resp.Status))
	}
	return readCharge(resp)
}

// reconcile looks up the charge made with the step's derived key (ctx's
// client key): done with its id if the processor has it, not done if it
// answers 404, an error if it cannot tell.
func (p *processorClient) reconcile(ctx context.Context) (string, bool, error) {
	key, _, _ := idemkey.KeyFromContext(ctx)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url+"?"+url.Values{"idempotency_key": {key}}.Encode(), nil)
	if err != nil {
		return "", false, err
	}
	resp, err := p.http.Do(req)
	if err != nil {
		return "", false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return "", false, nil
	}
	id, err := readCharge(resp)
	return id, err == nil, err
}

// readCharge reads the id of a charge from the processor's 200 answer.
func readCharge(resp *http.Response) (string, error) {
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%w %s", errProcessor, resp.Status)
	}
	var r processorReply
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&r); err != nil || r.ID == "" {
		return "", fmt.Errorf("%w with no charge id", errProcessor)
	}
	return r.ID, nil
}
