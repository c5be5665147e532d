package idemconnect_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemconnect"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// keyRecorder is a server interceptor that keeps the Idempotency-Key
// header of each call, in order.
type keyRecorder struct {
	mu   sync.Mutex
	keys [][]string
}

func (k *keyRecorder) intercept(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		k.mu.Lock()
		k.keys = append(k.keys, req.Header().Values(idemkey.KeyHeader))
		k.mu.Unlock()
		return next(ctx, req)
	}
}

func (k *keyRecorder) take() [][]string {
	k.mu.Lock()
	defer k.mu.Unlock()
	keys := k.keys
	k.keys = nil
	return keys
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
		if err := idemkey.ValidateKey(keys[0][0]); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("the caller's key", func(t *testing.T) {
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
		req.Header().Set(idemkey.KeyHeader, "from-header")
		if err := send(idemconnect.ContextWithKey(ctx, "from-context"), req); err != nil {
			t.Fatal(err)
		}
		if err := send(idemconnect.ContextWithKey(ctx, "from-context"), connect.NewRequest(&paymentsv1.CreateChargeRequest{})); err != nil {
			t.Fatal(err)
		}
		if keys := rec.take(); len(keys) != 2 || strings.Join(keys[0], ",") != "from-header" || strings.Join(keys[1], ",") != "from-context" {
			t.Fatalf("keys sent: %q; want the header's, then the context's", keys)
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
			{idemconnect.ContextWithKey(ctx, strings.Repeat("k", idemkey.MaxKeyLen+1)), connect.NewRequest(&paymentsv1.CreateChargeRequest{})},
			{ctx, twice},
			{ctx, spaced},
		} {
			err := send(tc.ctx, tc.req)
			if connect.CodeOf(err) != connect.CodeInvalidArgument || idemconnect.Reason(err) != idemkey.ReasonKeyInvalid ||
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
		if _, err := get.CallUnary(idemconnect.ContextWithKey(ctx, "k"), connect.NewRequest(&paymentsv1.GetChargeRequest{Id: "ch_1"})); err != nil {
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
	url := serve(t, runs.handle, newInterceptor(t, memory.New(), idemconnect.WithKeyRequired()))
	client := newChargeClient(t, url, connect.WithInterceptors(idemconnect.NewClientInterceptor()))
	req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: 100})
	first, err := client.CallUnary(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	retry, err := client.CallUnary(t.Context(), req)
	if err != nil || retry.Msg.GetId() != first.Msg.GetId() || !idemconnect.Replayed(retry.Header()) {
		t.Fatalf("retry: %v, %v; want the replay of %v", retry, err, first.Msg)
	}
	runs.wantRuns(t, 1)
}
