package idemgateway_test

import (
	"net/http"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemgateway"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/store/memory"
)

// The gateway forwards Idempotency-First-Region to the interceptor: region
// a holds off a key first sent to region b until b's record is in the store
// they share, then replays it; a malformed region is refused.
func TestFirstRegion(t *testing.T) {
	st, svc := memory.New(), newCharges()
	in := func(region string) string {
		return serveGateway(t, grpctest.Interceptor(st, engine.WithKeyRequired(), engine.WithRegion(region)), svc, idemgateway.ServeMuxOptions()...)
	}
	a, b := in("a"), in("b")
	saved := []string{idemkey.KeyHeader, "order-1", idemkey.FirstRegionHeader, "b"}
	fenced := post(t, a, charge, saved...)
	if fenced.status != http.StatusConflict || fenced.reason(t) != idemkey.ReasonInProgress || fenced.header.Get("Retry-After") == "" {
		t.Fatalf("region a, first sent to b: %d %q (%s); want 409 %q with Retry-After", fenced.status, fenced.reason(t), fenced.body, idemkey.ReasonInProgress)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Fatalf("CreateCharge ran %d times; want none", n)
	}
	first := post(t, b, charge, saved...)
	again := post(t, a, charge, saved...)
	if first.status != http.StatusOK || again.status != http.StatusOK || again.body != first.body ||
		!idemkey.ParseReplayed(again.header.Values(idemkey.ReplayedHeader)) {
		t.Fatalf("region b, then a: %d %s, then %d %s; want b's reply replayed by a", first.status, first.body, again.status, again.body)
	}
	for _, v := range []string{"EU", "a_b"} {
		bad := post(t, a, charge, idemkey.KeyHeader, "order-2", idemkey.FirstRegionHeader, v)
		if bad.status != http.StatusBadRequest || bad.reason(t) != idemkey.ReasonFirstSentInvalid {
			t.Errorf("first region %q: %d %q; want 400 %q", v, bad.status, bad.reason(t), idemkey.ReasonFirstSentInvalid)
		}
	}
	if n := svc.runs.Load(); n != 1 {
		t.Errorf("CreateCharge ran %d times; want once", n)
	}
}
