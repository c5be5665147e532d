package interceptor_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// A method named in an option that matches no method (a typo, a bare name,
// an uncovered method in atomic mode) fails when the interceptor is built,
// naming the option, rather than leave the option without effect.
func TestMisnamedMethodsFailAtStartUp(t *testing.T) {
	for name, tc := range map[string]struct {
		opts   []any
		client []interceptor.MethodOption // the same mistake made on the client, if it can be
		want   string
	}{
		"bare atomic name":     {[]any{interceptor.WithAtomicMethods("CreateCharge")}, nil, `WithAtomicMethods("CreateCharge")`},
		"atomic typo":          {[]any{interceptor.WithAtomicMethods(createCharge + "s")}, nil, "WithAtomicMethods"},
		"atomic, not covered":  {[]any{interceptor.WithAtomicMethods(getCharge)}, nil, "not covered"},
		"atomic, but excluded": {[]any{interceptor.WithAtomicMethods(createCharge), interceptor.WithExcludedMethods(createCharge)}, nil, "not covered"},
		"included typo": {
			[]any{interceptor.WithIncludedMethods("/example.payments.v1.PaymentService/GetCharges")},
			[]interceptor.MethodOption{interceptor.WithIncludedMethods("/example.payments.v1.PaymentService/GetCharges")}, "WithIncludedMethods"},
		"excluded, no such method": {
			[]any{interceptor.WithExcludedMethods("/nope.v1.Nope/Nope")},
			[]interceptor.MethodOption{interceptor.WithExcludedMethods("/nope.v1.Nope/Nope")}, "WithExcludedMethods"},
		"atomic on a store without transactions": {[]any{interceptor.WithAtomic()}, nil, "store.Atomic"},
	} {
		t.Run(name, func(t *testing.T) {
			if ic, err := serverInterceptorOf(memory.New(), tc.opts...); ic != nil || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("server interceptor: error %v, want one naming %q", err, tc.want)
			}
			if tc.client == nil {
				return
			}
			if ic, err := interceptor.UnaryClientInterceptor(tc.client...); ic != nil || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("client interceptor: error %v, want one naming %q", err, tc.want)
			}
		})
	}
}

// Without the client interceptor, a key the caller puts in the outgoing
// metadata reaches the server, and idemkey.ContextWithKey's, like UseKey's
// (TestUseKeyWithoutKeyedCall), does not: two calls with one key in the
// metadata run the handler once.
func TestCallerKeyWithoutClientInterceptor(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	if _, err := e.plain.CreateCharge(idemkey.ContextWithKey(ctx, idemkey.NewKey()), request(1)); err != nil {
		t.Fatal(err)
	}
	if got := drain(e.keys); len(got) != 0 {
		t.Errorf("ContextWithKey without the interceptor: the server saw keys %q, want none", got)
	}
	for name, call := range map[string]func(key string) (*paymentsv1.Charge, error){
		"metadata": func(key string) (*paymentsv1.Charge, error) {
			return e.plain.CreateCharge(metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key), request(1))
		},
	} {
		key := idemkey.NewKey()
		before := e.svc.runs.Load()
		first, err := call(key)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		again, err := call(key)
		if err != nil || again.GetId() != first.GetId() {
			t.Errorf("%s, again: %v, %v; want the first reply %v", name, again, err, first)
		}
		if runs := e.svc.runs.Load() - before; runs != 1 {
			t.Errorf("%s: two calls with one key ran the handler %d times, want 1", name, runs)
		}
		if got := drain(e.keys); len(got) != 2 || got[0] != key || got[1] != key {
			t.Errorf("%s: the server saw keys %q, want the caller's twice", name, got)
		}
	}
}

// serverInterceptorOf is UnaryServerInterceptor on a one-tenant engine on
// st, with its error.
func serverInterceptorOf(st store.Store, opts ...any) (grpc.UnaryServerInterceptor, error) {
	iopts := make([]interceptor.Option, len(opts))
	for i, o := range opts {
		iopts[i] = o.(interceptor.Option)
	}
	return interceptor.UnaryServerInterceptor(grpctest.Must(engine.New(st, engine.WithSingleTenant())), iopts...)
}

// An interceptor without an engine, or on an engine that cannot tell its
// callers apart, is refused when it is built, with the fix named: a shared
// key space is never the silent default.
func TestEngineMistakesFailAtStartUp(t *testing.T) {
	if ic, err := interceptor.UnaryServerInterceptor(nil); ic != nil || err == nil || !strings.Contains(err.Error(), "engine.New") {
		t.Errorf("nil engine: error %v, want one naming engine.New", err)
	}
	eng := grpctest.Must(engine.New(memory.New()))
	if ic, err := interceptor.UnaryServerInterceptor(eng); ic != nil || err == nil ||
		!strings.Contains(err.Error(), "engine.WithTenant") || !strings.Contains(err.Error(), "engine.WithSingleTenant") {
		t.Errorf("no tenant: error %v, want one naming engine.WithTenant and engine.WithSingleTenant", err)
	}
}
