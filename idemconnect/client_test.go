package idemconnect_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// keyRecorder is a server interceptor that keeps the request header of
// each call, in order.
type keyRecorder struct {
	mu      sync.Mutex
	headers []http.Header
}

func (k *keyRecorder) intercept(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		k.mu.Lock()
		k.headers = append(k.headers, req.Header().Clone())
		k.mu.Unlock()
		return next(ctx, req)
	}
}

// take returns the Idempotency-Key values of each call since the last take.
func (k *keyRecorder) take() [][]string { return k.takeValues(idemkey.KeyHeader) }

// takeValues returns the values of the header name of each call since the
// last take.
func (k *keyRecorder) takeValues(name string) [][]string {
	k.mu.Lock()
	defer k.mu.Unlock()
	values := make([][]string, len(k.headers))
	for i, h := range k.headers {
		values[i] = h.Values(name)
	}
	k.headers = nil
	return values
}

func TestClientInterceptor(t *testing.T) {
	rec := &keyRecorder{}
	runs := &counter{}
	url := serve(t, runs.handle, connect.UnaryInterceptorFunc(rec.intercept))
	opt := connect.WithInterceptors(idemconnect.NewClientInterceptor())
	client := newChargeClient(t, url, opt)
	ctx := t.Context()
	send := func(ctx context.Context, req *chargeRequest) error {
		_, err := client.CallUnary(ctx, req)
		return err
	}

	t.Run("a fresh key per call, kept by its retries", func(t *testing.T) {
		a := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
		b := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
		for _, req := range []*chargeRequest{a, a, b} { // a, its retry, another call
			if err := send(ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		keys := rec.take()
		if len(keys) != 3 || len(keys[0]) != 1 || len(keys[2]) != 1 ||
			strings.Join(keys[0], ",") != strings.Join(keys[1], ",") || keys[0][0] == keys[2][0] {
			t.Fatalf("keys sent: %q; want one key for a and its retry, another for b", keys)
		}
		// Sent as an RFC 8941 string, which a strict server reads.
		if key, err := idemkey.ParseKey(keys[0][0]); err != nil || keys[0][0] != idemkey.FormatKey(key) || keys[0][0][0] != '"' {
			t.Fatalf("sent %s (%v); want a key in double quotes", keys[0][0], err)
		}
	})
	t.Run("the caller's key", func(t *testing.T) {
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
		req.Header().Set(idemkey.KeyHeader, "from-header") // bare: sent as the same key, quoted
		if err := send(idemkey.ContextWithKey(ctx, "from-context"), req); err != nil {
			t.Fatal(err)
		}
		if err := send(idemkey.ContextWithKey(ctx, `a"b`), connect.NewRequest(&paymentsv1.CreateChargeRequest{})); err != nil {
			t.Fatal(err)
		}
		quoted := connect.NewRequest(&paymentsv1.CreateChargeRequest{})
		quoted.Header().Set(idemkey.KeyHeader, `"from-header"`)
		if err := send(ctx, quoted); err != nil {
			t.Fatal(err)
		}
		if keys := rec.take(); len(keys) != 3 || strings.Join(keys[0], ",") != `"from-header"` || strings.Join(keys[1], ",") != `"a\"b"` ||
			strings.Join(keys[2], ",") != `"from-header"` {
			t.Fatalf("keys sent: %q; want the header's, then the context's, then the header's, each an RFC 8941 string", keys)
		}
	})
	t.Run("a malformed key fails before it is sent", func(t *testing.T) {
		twice := connect.NewRequest(&paymentsv1.CreateChargeRequest{})
		twice.Header().Add(idemkey.KeyHeader, "a")
		twice.Header().Add(idemkey.KeyHeader, "b")
		spaced := connect.NewRequest(&paymentsv1.CreateChargeRequest{})
		spaced.Header().Set(idemkey.KeyHeader, "has space")
		for _, tc := range []struct {
			ctx context.Context
			req *chargeRequest
		}{
			{idemkey.ContextWithKey(ctx, strings.Repeat("k", idemkey.MaxKeyLen+1)), connect.NewRequest(&paymentsv1.CreateChargeRequest{})},
			{ctx, twice},
			{ctx, spaced},
		} {
			err := send(tc.ctx, tc.req)
			if connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyInvalid ||
				strings.Contains(err.Error(), "kkkk") || strings.Contains(err.Error(), "has space") {
				t.Errorf("got %v; want InvalidArgument, IDEMPOTENCY_KEY_INVALID, not quoting the key", err)
			}
		}
		if keys := rec.take(); len(keys) != 0 {
			t.Fatalf("sent %q", keys)
		}
	})
	t.Run("uncovered procedures get no key", func(t *testing.T) {
		// GetCharge is NO_SIDE_EFFECTS in the proto; the recorder sees its call too.
		get := connect.NewClient[paymentsv1.GetChargeRequest, paymentsv1.Charge](h2c(t), url+getCharge, opt)
		if _, err := get.CallUnary(idemkey.ContextWithKey(ctx, "k"), connect.NewRequest(&paymentsv1.GetChargeRequest{Id: "ch_1"})); err != nil {
			t.Fatal(err)
		}
		if keys := rec.take(); len(keys) != 1 || len(keys[0]) != 0 {
			t.Fatalf("keys sent: %q; want one call without a key", keys)
		}
	})
	t.Run("a misnamed procedure fails every call", func(t *testing.T) {
		bad := newChargeClient(t, url, connect.WithInterceptors(idemconnect.NewClientInterceptor(idemconnect.WithExcludedProcedures("CreateCharge"))))
		_, err := bad.CallUnary(ctx, connect.NewRequest(&paymentsv1.CreateChargeRequest{}))
		if ce := (*connect.Error)(nil); !errors.As(err, &ce) || ce.Code() != connect.CodeInternal || !strings.Contains(ce.Message(), "WithExcludedProcedures") {
			t.Fatalf("got %v; want Internal naming the option", err)
		}
	})
}

// With both interceptors, one call runs once however often the caller
// retries the same request.
func TestClientAndServer(t *testing.T) {
	runs := &counter{}
	url := serve(t, runs.handle, newInterceptor(t, single(t, engine.WithKeyRequired())))
	client := newChargeClient(t, url, connect.WithInterceptors(idemconnect.NewClientInterceptor()))
	req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
	first, err := client.CallUnary(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	retry, err := client.CallUnary(t.Context(), req)
	if err != nil || retry.Msg.GetId() != first.Msg.GetId() || !idemkey.ParseReplayed(retry.Header().Values(idemkey.ReplayedHeader)) {
		t.Fatalf("retry: %v, %v; want the replay of %v", retry, err, first.Msg)
	}
	runs.wantRuns(t, 1)
}

// The client sends when each operation was first sent, the same on every
// retry of one Request; a malformed one fails before it is sent.
func TestClientFirstSent(t *testing.T) {
	rec := &keyRecorder{}
	runs := &counter{}
	url := serve(t, runs.handle, connect.UnaryInterceptorFunc(rec.intercept), newInterceptor(t, single(t)))
	client := newChargeClient(t, url, connect.WithInterceptors(idemconnect.NewClientInterceptor()))
	ctx := t.Context()
	send := func(ctx context.Context, req *chargeRequest) error {
		_, err := client.CallUnary(ctx, req)
		return err
	}

	t.Run("now, kept by a retry of the same Request", func(t *testing.T) {
		before := time.Now().Truncate(time.Second)
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
		if err := send(ctx, req); err != nil {
			t.Fatal(err)
		}
		// The retry's context has another time; the Request's own wins.
		if err := send(idemkey.ContextWithKeyFirstSent(ctx, "other", before.Add(-time.Hour)), req); err != nil {
			t.Fatal(err)
		}
		sent := rec.takeValues(idemkey.FirstSentHeader)
		if len(sent) != 2 || len(sent[0]) != 1 || strings.Join(sent[1], ",") != sent[0][0] {
			t.Fatalf("first-sent times sent: %q; want one, the same on the retry", sent)
		}
		if at, err := idemkey.ParseDate(sent[0][0]); err != nil || at.Before(before) || at.After(time.Now()) {
			t.Fatalf("first sent %q, want the time of the call", sent[0][0])
		}
	})
	t.Run("the context's time", func(t *testing.T) {
		at := time.Now().Add(-time.Hour)
		if err := send(idemkey.ContextWithKeyFirstSent(ctx, "saved-key", at), connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 200})); err != nil {
			t.Fatal(err)
		}
		h := rec.takeValues(idemkey.FirstSentHeader)
		if len(h) != 1 || strings.Join(h[0], ",") != idemkey.FormatDate(at) {
			t.Fatalf("first-sent times sent: %q; want %s", h, idemkey.FormatDate(at))
		}
	})
	t.Run("the context's time goes only with the context's key", func(t *testing.T) {
		before := time.Now().Truncate(time.Second)
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 250})
		req.Header().Set(idemkey.KeyHeader, "own-key")
		if err := send(idemkey.ContextWithKeyFirstSent(ctx, "saved-key", before.Add(-time.Hour)), req); err != nil {
			t.Fatal(err)
		}
		h := rec.takeValues(idemkey.FirstSentHeader)
		if len(h) != 1 || len(h[0]) != 1 {
			t.Fatalf("first-sent times sent: %q; want one", h)
		}
		if at, err := idemkey.ParseDate(h[0][0]); err != nil || at.Before(before) {
			t.Fatalf("first sent %q with the request's own key; want now, not the context's time for another key", h[0][0])
		}
	})
	t.Run("an obsolete form in the header goes as an IMF-fixdate", func(t *testing.T) {
		at := time.Now().Add(-time.Hour)
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 300})
		req.Header().Set(idemkey.FirstSentHeader, at.UTC().Format("Monday, 02-Jan-06 15:04:05 GMT")) // RFC 850
		if err := send(ctx, req); err != nil {
			t.Fatal(err)
		}
		if h := rec.takeValues(idemkey.FirstSentHeader); len(h) != 1 || strings.Join(h[0], ",") != idemkey.FormatDate(at) {
			t.Fatalf("first-sent times sent: %q; want %s", h, idemkey.FormatDate(at))
		}
	})
	t.Run("a malformed one fails before it is sent", func(t *testing.T) {
		bad := connect.NewRequest(&paymentsv1.CreateChargeRequest{})
		bad.Header().Set(idemkey.FirstSentHeader, "secret-yesterday")
		twice := connect.NewRequest(&paymentsv1.CreateChargeRequest{})
		twice.Header().Add(idemkey.FirstSentHeader, idemkey.FormatDate(time.Now()))
		twice.Header().Add(idemkey.FirstSentHeader, idemkey.FormatDate(time.Now()))
		for _, req := range []*chargeRequest{bad, twice} {
			err := send(ctx, req)
			if connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonFirstSentInvalid ||
				strings.Contains(err.Error(), "secret") {
				t.Errorf("got %v; want InvalidArgument, IDEMPOTENCY_FIRST_SENT_INVALID, not quoting the value", err)
			}
		}
		if sent := rec.take(); len(sent) != 0 {
			t.Fatalf("sent %d calls", len(sent))
		}
	})
	runs.wantRuns(t, 4)
}

// KeyExpires reads until when the server honours a key, from a reply and
// from an error; a retry first sent before the retention, whose key has no
// record, is refused without running.
func TestKeyExpires(t *testing.T) {
	const retention = time.Hour
	runs := &counter{}
	started, gate := make(chan struct{}, 1), make(chan struct{})
	handle := func(ctx context.Context, req *chargeRequest) (*chargeResponse, error) {
		if req.Msg.GetDescription() == "block" {
			started <- struct{}{}
			select {
			case <-gate:
			case <-ctx.Done(): // the test failed, and its client hung up
				return nil, ctx.Err()
			}
		}
		return runs.handle(ctx, req)
	}
	url := serve(t, handle, newInterceptor(t, single(t, engine.WithRetention(retention), engine.WithInProgressWait(0))))
	for _, p := range []struct {
		name string
		opts []connect.ClientOption
	}{{"connect", nil}, {"grpc", []connect.ClientOption{connect.WithGRPC()}}} {
		t.Run(p.name, func(t *testing.T) {
			client := newChargeClient(t, url, append(p.opts, connect.WithInterceptors(idemconnect.NewClientInterceptor()))...)
			ctx := t.Context()
			key := p.name + "-k1"

			sent := time.Now()
			resp, err := client.CallUnary(idemkey.ContextWithKey(ctx, key), connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100}))
			if err != nil {
				t.Fatal(err)
			}
			exp, ok := idemkey.ParseExpires(resp.Header().Values(idemkey.ExpiresHeader))
			if d := exp.Sub(sent); !ok || d < retention-time.Second || d > retention+time.Second {
				t.Fatalf("expiry %q, %v after the call; want the retention, %v", resp.Header().Get(idemkey.ExpiresHeader), d, retention)
			}
			// The replay tells the same expiry, and so does a duplicate
			// answered in progress, in its error's metadata.
			replay, err := client.CallUnary(idemkey.ContextWithKey(ctx, key), connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100}))
			if got, _ := idemkey.ParseExpires(replay.Header().Values(idemkey.ExpiresHeader)); err != nil || !got.Equal(exp) {
				t.Fatalf("replay: %v, expiry %v; want %v", err, got, exp)
			}
			done := make(chan error, 1)
			blocked := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 300, Description: "block"})
			go func() {
				_, err := client.CallUnary(idemkey.ContextWithKey(ctx, key+"-blocked"), blocked)
				done <- err
			}()
			<-started
			_, err = client.CallUnary(idemkey.ContextWithKey(ctx, key+"-blocked"), connect.NewRequest(blocked.Msg))
			ce := (*connect.Error)(nil)
			if !errors.As(err, &ce) || idemkey.Reason(err) != idemkey.ReasonInProgress {
				t.Fatalf("duplicate: %v, want in progress", err)
			}
			if got, ok := idemkey.ParseExpires(ce.Meta().Values(idemkey.ExpiresHeader)); !ok || got.Sub(exp) < 0 || got.Sub(exp) > time.Minute {
				t.Fatalf("in progress told the expiry %q, want one from about when it was first sent", ce.Meta().Values(idemkey.ExpiresHeader))
			}
			gate <- struct{}{}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			runsBefore := runs.runs.Load()

			// A restarted process retries a key it saved two hours ago, which
			// has no record: refused, not run.
			_, err = client.CallUnary(idemkey.ContextWithKeyFirstSent(ctx, key+"-stale", time.Now().Add(-2*retention)),
				connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100}))
			if connect.CodeOf(err) != connect.CodeFailedPrecondition || idemkey.Reason(err) != idemkey.ReasonKeyExpired {
				t.Fatalf("stale retry: %v; want FailedPrecondition, IDEMPOTENCY_KEY_EXPIRED", err)
			}
			if errors.As(err, &ce) {
				if _, ok := idemkey.ParseExpires(ce.Meta().Values(idemkey.ExpiresHeader)); ok {
					t.Fatalf("expiry %q for a key that has no record", ce.Meta().Values(idemkey.ExpiresHeader))
				}
			}
			runs.wantRuns(t, runsBefore)
		})
	}
}

// The client sends the first region a caller gives with its key, and only
// with that key; a malformed one fails before it is sent.
func TestClientFirstRegion(t *testing.T) {
	rec := &keyRecorder{}
	runs := &counter{}
	url := serve(t, runs.handle, connect.UnaryInterceptorFunc(rec.intercept), newInterceptor(t, single(t)))
	client := newChargeClient(t, url, connect.WithInterceptors(idemconnect.NewClientInterceptor()))
	ctx, at := t.Context(), time.Now().Add(-time.Minute)
	withHeader := func(amount int64, kv ...string) *chargeRequest {
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: amount})
		for i := 0; i+1 < len(kv); i += 2 {
			req.Header().Add(kv[i], kv[i+1])
		}
		return req
	}
	for _, tc := range []struct {
		name string
		ctx  context.Context
		req  *chargeRequest
		want string // "": none
	}{
		{"the context's", idemkey.ContextWithKeyFirstRegion(ctx, "order-1", at, "eu-west-1"), withHeader(100), "eu-west-1"},
		{"none", idemkey.ContextWithKeyFirstRegion(ctx, "order-2", at, ""), withHeader(200), ""},
		{"the request's key drops the context's region",
			idemkey.ContextWithKeyFirstRegion(ctx, "order-3", at, "eu-west-1"), withHeader(300, idemkey.KeyHeader, "order-4"), ""},
		{"the header's is kept", ctx, withHeader(400, idemkey.FirstSentHeader, idemkey.FormatDate(at), idemkey.FirstRegionHeader, "us-east-2"), "us-east-2"},
	} {
		if _, err := client.CallUnary(tc.ctx, tc.req); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := rec.takeValues(idemkey.FirstRegionHeader); len(got) != 1 || strings.Join(got[0], ",") != tc.want {
			t.Errorf("%s: first regions sent %q, want [%q]", tc.name, got, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		ctx  context.Context
		req  *chargeRequest
	}{
		{"the context's", idemkey.ContextWithKeyFirstRegion(ctx, "order-5", at, "Secret-Region"), withHeader(500)},
		{"the header's", ctx, withHeader(500, idemkey.FirstRegionHeader, "secret_region")},
		{"the header's, twice", ctx, withHeader(500, idemkey.FirstRegionHeader, "a", idemkey.FirstRegionHeader, "a")},
		// A region without the time the key was first sent would be told
		// "now" at every attempt: never stale where its record never comes.
		{"the context's without a time", idemkey.ContextWithKeyFirstRegion(ctx, "order-6", time.Time{}, "eu-west-1"), withHeader(600)},
		{"the header's without a time", ctx, withHeader(600, idemkey.FirstRegionHeader, "eu-west-1")},
	} {
		_, err := client.CallUnary(tc.ctx, tc.req)
		if connect.CodeOf(err) != connect.CodeInvalidArgument || idemkey.Reason(err) != idemkey.ReasonFirstSentInvalid ||
			strings.Contains(strings.ToLower(err.Error()), "secret") {
			t.Errorf("%s: %v; want InvalidArgument, IDEMPOTENCY_FIRST_SENT_INVALID, not quoting the value", tc.name, err)
		}
	}
	if sent := rec.take(); len(sent) != 0 {
		t.Fatalf("malformed regions sent %d calls", len(sent))
	}
	runs.wantRuns(t, 4)
}
