package interceptor_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func TestClientCallerKeys(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"UseKey", func() error {
			_, err := e.client.CreateCharge(ctx, request(1), interceptor.UseKey("order-1"))
			return err
		}, "order-1"},
		{"ContextWithKey", func() error {
			_, err := e.client.CreateCharge(idemkey.ContextWithKey(ctx, "order-2"), request(1))
			return err
		}, "order-2"},
		{"UseKey wins over the context", func() error {
			_, err := e.client.CreateCharge(idemkey.ContextWithKey(ctx, "ctx"), request(1), interceptor.UseKey("order-3"))
			return err
		}, "order-3"},
		{"metadata set by the caller is kept", func() error {
			_, err := e.client.CreateCharge(metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "order-4"), request(1))
			return err
		}, "order-4"},
		// Metadata carries a key bare, as gRPC clients send keys, unless
		// the server would read it otherwise.
		{"UseKey of a key that needs quoting", func() error {
			_, err := e.client.CreateCharge(ctx, request(1), interceptor.UseKey(`a"b`))
			return err
		}, `"a\"b"`},
		{"ContextWithKey of a key that needs quoting", func() error {
			_, err := e.client.CreateCharge(idemkey.ContextWithKey(ctx, "a,b"), request(1))
			return err
		}, `"a,b"`},
	} {
		if err := tc.call(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := drain(e.keys); len(got) != 1 || got[0] != tc.want {
			t.Errorf("%s: the server saw keys %q, want [%s]", tc.name, got, tc.want)
		}
	}
}

func TestClientRefusesBadKey(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	for _, key := range []string{"", "sp ace", string(make([]byte, 300))} {
		_, err := e.client.CreateCharge(ctx, request(1), interceptor.UseKey(key))
		wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyInvalid)
	}
	if got := drain(e.keys); len(got) != 0 {
		t.Errorf("bad keys reached the server: %d calls", len(got))
	}
	wantRuns(t, e.svc, 0)
}

func TestClientLeavesUncoveredMethods(t *testing.T) {
	e := newE2E(t)
	ctx := idemkey.ContextWithKey(metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme"), "order-1")
	if _, err := e.client.GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: "ch_1"}); err != nil {
		t.Fatal(err)
	}
	if got := drain(e.keys); len(got) != 0 {
		t.Errorf("GetCharge (NO_SIDE_EFFECTS) carried keys %q, want none", got)
	}
}
