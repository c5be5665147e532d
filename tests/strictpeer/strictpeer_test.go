// Package strictpeer_test checks the Idempotency-Key values idemkey's HTTP
// and Connect clients send against a strict RFC 8941 parser
// (github.com/dunglas/httpsfv), as a server that implements
// draft-ietf-httpapi-idempotency-key-header-07 to the letter reads them: an
// sf-string holding the key, with no parameters. The values are captured on
// a loopback server, which serves them with idemkey's own servers too, and
// those must read the same key.
package strictpeer_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/dunglas/httpsfv"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/idemhttp"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// newKeys is how many keys of NewKey each client sends.
const newKeys = 1000

// Every key NewKey makes, and every key README.md shows, is read by a strict
// RFC 8941 parser as the string of that key, and by idemkey's server as that
// key, when idemkey's HTTP and Connect clients send it.
func TestStrictPeerReadsKeys(t *testing.T) {
	keys := readmeKeys(t)
	for range newKeys {
		keys = append(keys, idemkey.NewKey())
	}
	srv := newServer(t)
	clients := map[string]func(ctx context.Context, key string) error{
		"http":     srv.postHTTP,
		"connect":  srv.connectCall(),
		"grpc-web": srv.connectCall(connect.WithGRPCWeb()),
	}
	for name, send := range clients {
		t.Run(name, func(t *testing.T) {
			for _, key := range keys {
				if err := send(t.Context(), key); err != nil {
					t.Fatalf("sending a key: %v", err)
				}
				sent, read := srv.take()
				if len(sent) != 1 {
					t.Fatalf("the server got %d Idempotency-Key values, want one", len(sent))
				}
				item, err := httpsfv.UnmarshalItem(sent)
				if err != nil {
					t.Fatalf("a strict parser refuses %s, sent for %q: %v", sent[0], key, err)
				}
				if s, ok := item.Value.(string); !ok || s != key || len(item.Params.Names()) != 0 {
					t.Fatalf("a strict parser reads %s, sent for %q, as %T %v with parameters %q; want the string %q",
						sent[0], key, item.Value, item.Value, item.Params.Names(), key)
				}
				if !slices.Equal(read, []string{key}) {
					t.Fatalf("idemkey's server read %s, sent for %q, as %q; want the key", sent[0], key, read)
				}
			}
		})
	}
}

// The parser is strict: no bare key is the string of that key, and a bare
// key that starts with a digit, as most UUIDs do, is refused or read as a
// number. So the quoting the clients do is what the test above sees.
func TestStrictPeerRefusesBareKeys(t *testing.T) {
	keys := readmeKeys(t)
	digit := 0
	for range newKeys {
		keys = append(keys, idemkey.NewKey())
	}
	for _, key := range keys {
		item, err := httpsfv.UnmarshalItem([]string{key})
		if s, ok := item.Value.(string); err == nil && ok && s == key {
			t.Fatalf("a strict parser reads the bare key %q as its string", key)
		}
		if key[0] >= '0' && key[0] <= '9' {
			digit++
			switch item.Value.(type) {
			case int64, float64: // an integer or a decimal
			default:
				if err == nil {
					t.Errorf("a strict parser reads the bare key %q as %T %v", key, item.Value, item.Value)
				}
			}
		}
	}
	if digit == 0 {
		t.Fatal("no key starts with a digit")
	}
}

// server is a loopback server with idemkey's net/http middleware on
// /v1/charges and its Connect interceptor on CreateCharge, one engine for
// both. It keeps the Idempotency-Key values of each request, as they came,
// and the key idemkey's server read from them (its hooks' Event.Key).
type server struct {
	url    string
	client *http.Client

	mu   sync.Mutex
	sent []string // the header values of the last request
	read []string // the keys the engine read since the last take
}

const createCharge = "/example.payments.v1.PaymentService/CreateCharge"

func newServer(t *testing.T) *server {
	s := &server{}
	keep := func(_ context.Context, ev engine.Event) {
		s.mu.Lock()
		s.read = append(s.read, ev.Key)
		s.mu.Unlock()
	}
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithKeyRequired(),
		engine.WithHooks(engine.Hooks{OnExecute: keep, OnReplay: keep, OnRefuse: keep}))
	if err != nil {
		t.Fatal(err)
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		t.Fatal(err)
	}
	connectIdem, err := idemconnect.NewServerInterceptor(eng)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idem(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	mux.Handle(createCharge, connect.NewUnaryHandler(createCharge,
		func(context.Context, *connect.Request[paymentsv1.CreateChargeRequest]) (*connect.Response[paymentsv1.Charge], error) {
			return connect.NewResponse(&paymentsv1.Charge{Id: "ch_1"}), nil
		}, connect.WithInterceptors(connectIdem)))
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.sent = slices.Clone(r.Header.Values(idemkey.KeyHeader))
		s.mu.Unlock()
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	s.url, s.client = hs.URL, hs.Client()
	return s
}

// take returns the header values of the last request and the keys the
// engine read since the last take.
func (s *server) take() (sent, read []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sent, read = s.sent, s.read
	s.sent, s.read = nil, nil
	return sent, read
}

// postHTTP posts a charge with key as a plain HTTP client does: the
// Idempotency-Key header idemkey.FormatKey writes.
func (s *server) postHTTP(ctx context.Context, key string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url+"/v1/charges", strings.NewReader(`{"amount":100}`))
	if err != nil {
		return err
	}
	req.Header.Set(idemkey.KeyHeader, idemkey.FormatKey(key))
	resp, err := s.client.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("status %s, want 201 Created", resp.Status)
	}
	return nil
}

// connectCall returns a sender that calls CreateCharge with key through
// idemconnect's client interceptor (idemkey.ContextWithKey), over the
// protocol of opts.
func (s *server) connectCall(opts ...connect.ClientOption) func(ctx context.Context, key string) error {
	client := connect.NewClient[paymentsv1.CreateChargeRequest, paymentsv1.Charge](s.client, s.url+createCharge,
		append(opts, connect.WithInterceptors(idemconnect.NewClientInterceptor()))...)
	return func(ctx context.Context, key string) error {
		_, err := client.CallUnary(idemkey.ContextWithKey(ctx, key), connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100}))
		return err
	}
}

// The places README.md shows a key: an Idempotency-Key header's value (read
// with ParseKey: bare or an RFC 8941 string), the -key flag of the idemkey
// command, key= in a hook's line, a UUID named an idempotency key in prose,
// and a Go string literal given to UseKey, UseKeyFirstSent, ContextWithKey
// or ContextWithKeyFirstSent.
var (
	readmeHeaderKey = regexp.MustCompile(`(?i)\bidempotency-key:[ \t]*([^\s']+)`)
	readmeRawKeys   = []*regexp.Regexp{
		regexp.MustCompile(`(?:^|\s)-key ([^\s'"]+)`),
		regexp.MustCompile(`\bkey=([^\s%]\S*)`),
		regexp.MustCompile(`(?i)\bidempotency key ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\b`),
	}
	readmeGoKey = regexp.MustCompile(`\b(?:UseKey(?:FirstSent)?\(|ContextWithKey(?:FirstSent)?\([^,()]+,\s*)("(?:[^"\\]|\\.)*")`)
)

// readmeKeys returns the keys README.md and docs/ show, each once, in order; it
// fails the test if there are none, or one is not a valid key.
func readmeKeys(t *testing.T) []string {
	t.Helper()
	// The README's snippets and sessions moved into docs/: read both.
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	var text string
	for _, page := range append([]string{"../../README.md"}, pages...) {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		text += string(b) + "\n"
	}
	var keys []string
	add := func(key string) {
		if err := idemkey.ValidateKey(key); err != nil {
			t.Fatalf("README.md shows a key that is not valid (%v)", err)
		}
		if !slices.Contains(keys, key) {
			keys = append(keys, key)
		}
	}
	for _, m := range readmeHeaderKey.FindAllStringSubmatch(text, -1) {
		key, err := idemkey.ParseKey(m[1])
		if err != nil {
			t.Fatalf("README.md's header value %s is not a key: %v", m[1], err)
		}
		add(key)
	}
	for _, re := range readmeRawKeys {
		for _, m := range re.FindAllStringSubmatch(text, -1) {
			add(m[1])
		}
	}
	for _, m := range readmeGoKey.FindAllStringSubmatch(text, -1) {
		key, err := strconv.Unquote(m[1])
		if err != nil {
			t.Fatalf("README.md's Go string %s: %v", m[1], err)
		}
		add(key)
	}
	if len(keys) == 0 {
		t.Fatal("found no key in README.md")
	}
	t.Logf("README.md shows the keys %q", keys)
	return keys
}
