package interceptor_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/sealtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// stored returns the record the memory store holds for the call of key by
// tenant acme.
func (d *direct) stored(t *testing.T, key string) []byte {
	t.Helper()
	res, found, err := d.store.Find(t.Context(), store.ScopeKey("acme", createCharge, key))
	if err != nil || !found {
		t.Fatalf("no record of %s: %v", key, err)
	}
	return res.Outcome
}

// The record holds none of the reply, nor of its replayed metadata, in the
// clear; the replay is the reply.
func TestSealedRecord(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), engine.WithSealer(sealtest.Ring(t, 1)),
		interceptor.WithReplayedMetadata("x-charge-token"))
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-token", "tok_secret"))
		return &paymentsv1.Charge{Id: "ch_1", CustomerId: "cus_secret_alice"}, nil
	}
	first, _, err := d.create(t, "k1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	if rec := d.stored(t, "k1"); bytes.Contains(rec, []byte("secret")) {
		t.Fatalf("the store holds the reply in the clear: %q", rec)
	}
	replay, ts, err := d.create(t, "k1", request(100))
	if err != nil || replay.GetCustomerId() != first.GetCustomerId() || ts.header.Get("x-charge-token")[0] != "tok_secret" {
		t.Fatalf("replay %v, header %v, %v; want the first reply", replay, ts.header, err)
	}
	wantRuns(t, d.svc, 1)
}

func TestRedaction(t *testing.T) {
	redact := func(_ context.Context, method string, r *interceptor.Reply) {
		if method != createCharge {
			panic("method " + method)
		}
		if c, ok := r.Response.(*paymentsv1.Charge); ok {
			c.CustomerId = ""
		}
		delete(r.Header, "x-charge-token")
	}
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithRedaction(redact),
		interceptor.WithReplayedMetadata("x-charge-token", "x-region"))
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-token", "tok_secret", "x-region", "eu"))
		return &paymentsv1.Charge{Id: "ch_1", CustomerId: "cus_secret_alice", Amount: req.GetAmount()}, nil
	}
	first, ts, err := d.create(t, "k1", request(100))
	if err != nil || first.GetCustomerId() != "cus_secret_alice" || ts.header.Get("x-charge-token")[0] != "tok_secret" {
		t.Fatalf("first call: %v, header %v, %v; want the whole reply", first, ts.header, err)
	}
	if rec := d.stored(t, "k1"); bytes.Contains(rec, []byte("secret")) {
		t.Fatalf("the record holds what was redacted: %q", rec)
	}
	replay, ts, err := d.create(t, "k1", request(100))
	if err != nil || replay.GetCustomerId() != "" || replay.GetId() != "ch_1" || replay.GetAmount() != 100 {
		t.Fatalf("replay %v, %v; want the redacted reply", replay, err)
	}
	if ts.header.Get("x-charge-token") != nil || ts.header.Get("x-region")[0] != "eu" {
		t.Fatalf("replayed header %v, want x-region alone", ts.header)
	}
	wantRuns(t, d.svc, 1)
}

// A redaction may record an error in place of a response: the first caller
// gets the response, every retry the error.
func TestRedactionRecordsAnError(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithRedaction(
		func(_ context.Context, _ string, r *interceptor.Reply) {
			r.Err = status.Error(codes.FailedPrecondition, "credentials already issued")
		}))
	if _, _, err := d.create(t, "k1", request(100)); err != nil {
		t.Fatal(err)
	}
	_, ts, err := d.create(t, "k1", request(100))
	if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "credentials already issued" || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("replay: %v, trailer %v", err, ts.trailer)
	}
	wantRuns(t, d.svc, 1)
}

// A redaction that panics, or leaves a reply that cannot be recorded,
// records Internal: the handler has run, so its key is not released.
func TestRedactionThatFails(t *testing.T) {
	for name, redact := range map[string]interceptor.RedactFunc{
		"panics":           func(context.Context, string, *interceptor.Reply) { panic("cannot redact charge: card 4242") },
		"no response":      func(_ context.Context, _ string, r *interceptor.Reply) { r.Response = nil },
		"another type":     func(_ context.Context, _ string, r *interceptor.Reply) { r.Response = &emptypb.Empty{} },
		"error to success": func(_ context.Context, _ string, r *interceptor.Reply) { r.Err = nil },
	} {
		t.Run(name, func(t *testing.T) {
			logger, logs := logtest.New()
			d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithRedaction(redact), engine.WithLogger(logger))
			if name == "error to success" {
				d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
					return nil, status.Error(codes.FailedPrecondition, "declined")
				}
			}
			for range 2 {
				if _, _, err := d.create(t, "k1", request(100)); status.Code(err) != codes.Internal {
					t.Fatalf("got %v, want the Internal recorded in place of the reply", err)
				}
			}
			wantRuns(t, d.svc, 1)
			if !strings.Contains(logs.String(), "redaction function") {
				t.Fatalf("the log does not say what failed:\n%s", logs)
			}
			if strings.Contains(logs.String(), "4242") {
				t.Errorf("the log quotes the redaction function's panic, which holds what it was removing:\n%s", logs)
			}
		})
	}
}

// A record that does not open answers Unavailable, as a failed store does,
// and is logged at Error without the key or the tenant; a grpc-go client
// with the example's retry policy retries it, and the handler never runs
// again.
func TestUnopenedRecordOverGRPC(t *testing.T) {
	logger, logs := logtest.New()
	e := newE2E(t, engine.WithSealer(sealtest.Ring(t, 1)), engine.WithLogger(logger))
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := e.client.CreateCharge(withKey(ctx, "order-secret-1"), request(100)); err != nil {
		t.Fatal(err)
	}
	// Copy the record of order-secret-1 onto the record of another key, as
	// someone with write access to the store could.
	from := store.ScopeKey("acme", createCharge, "order-secret-1")
	to := store.ScopeKey("acme", createCharge, "order-secret-2")
	res, _, err := e.store.Find(ctx, from)
	if err != nil {
		t.Fatal(err)
	}
	got, err := e.store.Reserve(ctx, store.Reservation{Key: to, Fingerprint: res.Fingerprint, Lease: time.Minute, Retention: time.Hour})
	if err != nil || got.State != store.Acquired {
		t.Fatalf("reserve: %v %v", got.State, err)
	}
	if err := e.store.Complete(ctx, to, got.Token, res.Outcome); err != nil {
		t.Fatal(err)
	}
	_, err = e.client.CreateCharge(withKey(ctx, "order-secret-2"), request(100))
	wantReason(t, err, codes.Unavailable, idemkey.ReasonStoreUnavailable)
	wantRuns(t, e.svc, 1)
	if l := logs.String(); !strings.Contains(l, "level=ERROR") || !strings.Contains(l, "does not open") ||
		strings.Contains(l, "order-secret") || strings.Contains(l, "acme") {
		t.Fatalf("want an Error naming no key or tenant:\n%s", l)
	}
}
