package interceptor_test

import (
	"cmp"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// The first-sent time the client interceptor sends is taken once per call,
// so the attempts of gRPC's retry policy carry the same one, even when a
// second has passed between them.
func TestClientFirstSentSameOnEveryAttempt(t *testing.T) {
	e := newE2E(t)
	e.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		if e.svc.runs.Load() == 1 {
			// Past the next whole second, which a time taken per attempt
			// would show.
			time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second + 50*time.Millisecond)))
			return nil, status.Error(codes.Unavailable, "try again")
		}
		return chargeFor(req, 1), nil
	}
	before := time.Now().Truncate(time.Second)
	if _, err := e.client.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme"), request(100)); err != nil {
		t.Fatal(err)
	}
	wantRuns(t, e.svc, 2)
	sent := drain(e.sent)
	if len(sent) != 2 || sent[0] != sent[1] {
		t.Fatalf("the attempts carried first-sent times %q, want one, twice", sent)
	}
	if got, err := idemkey.ParseDate(sent[0]); err != nil || got.Before(before) || got.After(time.Now()) {
		t.Errorf("first-sent %q, want the time of the call", sent[0])
	}
}

func TestClientFirstSentGiven(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	at := time.Now().Add(-time.Hour)
	want := idemkey.FormatDate(at)
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"UseKeyFirstSent", func() error {
			_, err := e.client.CreateCharge(ctx, request(1), interceptor.UseKeyFirstSent("order-1", at))
			return err
		}, want},
		{"ContextWithKeyFirstSent", func() error {
			_, err := e.client.CreateCharge(idemkey.ContextWithKeyFirstSent(ctx, "order-3", at), request(1))
			return err
		}, want},
		{"the caller's metadata without the interceptor", func() error {
			md := metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, "order-4", idemkey.FirstSentMetadata, want)
			_, err := e.plain.CreateCharge(md, request(1))
			return err
		}, want},
		{"the caller's key wins over the context's, and the context's time", func() error {
			md := metadata.AppendToOutgoingContext(idemkey.ContextWithKeyFirstSent(ctx, "ctx-2", at), idemkey.KeyMetadata, "order-6")
			_, err := e.client.CreateCharge(md, request(1))
			return err
		}, ""},
		{"metadata set by the caller is kept", func() error {
			_, err := e.client.CreateCharge(metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, want), request(1))
			return err
		}, want},
		{"an obsolete form set by the caller goes as an IMF-fixdate", func() error {
			asctime := at.UTC().Format("Mon Jan _2 15:04:05 2006")
			_, err := e.client.CreateCharge(metadata.AppendToOutgoingContext(ctx, idemkey.FirstSentMetadata, asctime), request(1))
			return err
		}, want},
		{"UseKey wins over the context, with its own time", func() error {
			_, err := e.client.CreateCharge(idemkey.ContextWithKeyFirstSent(ctx, "ctx", at), request(1), interceptor.UseKey("order-5"))
			return err
		}, ""},
	} {
		if err := tc.call(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		sent := drain(e.sent)
		if len(sent) != 1 || tc.want != "" && sent[0] != tc.want || tc.want == "" && sent[0] == want {
			t.Errorf("%s: the server saw first-sent %q, want one (%s)", tc.name, sent, cmp.Or(tc.want, "now"))
		}
		if keys := drain(e.keys); len(keys) != 1 {
			t.Errorf("%s: the server saw keys %q, want one", tc.name, keys)
		}
	}
}

func TestClientRefusesBadFirstSent(t *testing.T) {
	e := newE2E(t)
	for name, pairs := range map[string][]string{
		"malformed":  {idemkey.FirstSentMetadata, "yesterday"},
		"two values": {idemkey.FirstSentMetadata, idemkey.FormatDate(time.Now()), idemkey.FirstSentMetadata, idemkey.FormatDate(time.Now())},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), append(pairs, "tenant", "acme")...)
		_, err := e.client.CreateCharge(ctx, request(100))
		if status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonFirstSentInvalid {
			t.Errorf("%s: got %v, want InvalidArgument %s", name, err, idemkey.ReasonFirstSentInvalid)
		}
	}
	if got := drain(e.keys); len(got) != 0 {
		t.Errorf("calls with a bad first-sent time reached the server: %d", len(got))
	}
	wantRuns(t, e.svc, 0)
}

// A retry first sent longer ago than keys are kept, whose key has no
// record, is refused rather than run.
func TestClientStaleFirstSentRefused(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	var expires time.Time
	_, err := e.client.CreateCharge(ctx, request(100),
		interceptor.UseKeyFirstSent("order-1", time.Now().Add(-engine.DefaultRetention-time.Hour)), interceptor.KeyExpiry(&expires))
	wantReason(t, err, codes.FailedPrecondition, idemkey.ReasonKeyExpired)
	wantRuns(t, e.svc, 0)
	if !expires.IsZero() {
		t.Errorf("the refusal told the expiry %v, want none", expires)
	}
}

// KeyExpiry tells the same instant on the first reply and on its replays,
// and a caller's own grpc.Header and grpc.Trailer still get the metadata.
func TestClientKeyExpiry(t *testing.T) {
	e := newE2E(t)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	var first time.Time
	if _, err := e.client.CreateCharge(ctx, request(100), interceptor.UseKey("order-1"), interceptor.KeyExpiry(&first)); err != nil {
		t.Fatal(err)
	}
	if d := time.Until(first); d < engine.DefaultRetention-time.Minute || d > engine.DefaultRetention {
		t.Fatalf("expiry %v is %v from now, want about %v", first, d, engine.DefaultRetention)
	}
	replay := time.Now() // overwritten: zero if the server did not say
	var header, trailer metadata.MD
	if _, err := e.client.CreateCharge(ctx, request(100), interceptor.UseKey("order-1"),
		grpc.Header(&header), interceptor.KeyExpiry(&replay), grpc.Trailer(&trailer)); err != nil {
		t.Fatal(err)
	}
	if !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || !replay.Equal(first) {
		t.Errorf("replay told the expiry %v (replayed: %v), want the first reply's %v", replay, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), first)
	}
	if got, ok := idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata)); !ok || !got.Equal(first) {
		t.Errorf("the caller's own trailer %v has the expiry %v, want %v", trailer, got, first)
	}
	// An error about the key tells it in the trailer.
	var reused time.Time
	_, err := e.client.CreateCharge(ctx, request(999), interceptor.UseKey("order-1"), interceptor.KeyExpiry(&reused))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)
	if !reused.Equal(first) {
		t.Errorf("reused told the expiry %v, want %v", reused, first)
	}
	// A key that is released tells none.
	e.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return nil, status.Error(codes.PermissionDenied, "no")
	}
	released := time.Now()
	_, err = e.client.CreateCharge(ctx, request(100), interceptor.UseKey("order-2"), interceptor.KeyExpiry(&released))
	if status.Code(err) != codes.PermissionDenied || !released.IsZero() {
		t.Errorf("a released key: %v, expiry %v; want PermissionDenied and none", err, released)
	}
}

// The expiry goes in the trailer, even of a reply: an interceptor outside
// idemkey that puts an error in the reply's place (here, a reply lost)
// leaves a trailers-only answer, which gRPC's retry policy retries.
func TestExpiryKeepsAnErrorRetryable(t *testing.T) {
	svc := newService()
	loseFirstReply := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if len(metadata.ValueFromIncomingContext(ctx, interceptor.AttemptsMetadata)) > 0 {
			return handler(ctx, req)
		}
		if _, err := handler(ctx, req); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.Unavailable, "reply lost")
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(loseFirstReply,
		grpctest.Interceptor(memory.New(), engine.WithTenant(tenantFromMetadata))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv),
		grpc.WithDefaultServiceConfig(retryServiceConfig), grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))

	var header, trailer metadata.MD
	var expires time.Time
	_, err := client.CreateCharge(metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme"), request(100),
		grpc.Header(&header), grpc.Trailer(&trailer), interceptor.KeyExpiry(&expires))
	if err != nil {
		t.Fatalf("call with the first reply lost: %v, want the replay", err)
	}
	wantRuns(t, svc, 1)
	if !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || expires.IsZero() || len(header.Get(idemkey.ExpiresMetadata)) != 0 {
		t.Errorf("header %v, trailer %v; want the replay, with the expiry in the trailer", header, trailer)
	}
}

// Each answer tells its own key's expiry, whichever trailers the server
// keeps (a minute's, one a second): a replay and a duplicate of a key whose
// trailers were replaced by those of a first call 64 seconds later, and a
// key first called in the same second as that one, which shares them.
func TestExpiryOfEachKey(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	expiry := func(key string, req *paymentsv1.CreateChargeRequest) (string, error) {
		t.Helper()
		_, ts, err := d.create(t, key, req)
		if got := ts.trailer.Get(idemkey.ExpiresMetadata); len(got) != 1 {
			t.Fatalf("%s: trailer %v, want one expiry", key, ts.trailer)
		}
		return ts.trailer.Get(idemkey.ExpiresMetadata)[0], err
	}
	first, err := expiry("key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	for _, later := range []time.Duration{time.Second, 63 * time.Second, 300 * time.Millisecond} {
		d.clock.Advance(t, later)
		if _, err := expiry("key-"+later.String(), request(100)); err != nil {
			t.Fatal(err)
		}
	}
	last, _ := expiry("key-300ms", request(100))
	want := idemkey.FormatDate(d.clock.Now().Add(engine.DefaultRetention))
	if last != want {
		t.Errorf("the last key's replay told %s, want %s", last, want)
	}
	if got, err := expiry("key-1", request(100)); err != nil || got != first {
		t.Errorf("key-1's replay: %v, told %s; want its first call's %s", err, got, first)
	}
	got, err := expiry("key-1", request(999))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)
	if got != first {
		t.Errorf("key-1 reused told %s, want its first call's %s", got, first)
	}
}

// TestMethodRetention: a method's own retention (WithMethodRetention) is its
// keys' expiry; the interceptor refuses one for a method it does not cover,
// or shorter than the engine's longest lease.
func TestMethodRetention(t *testing.T) {
	const month = 31 * 24 * time.Hour
	for _, tc := range []struct {
		opts      []any
		retention time.Duration
	}{
		{[]any{engine.WithTenant(tenantFromMetadata)}, engine.DefaultRetention},
		{[]any{engine.WithTenant(tenantFromMetadata), interceptor.WithMethodRetention(month, createCharge)}, month},
	} {
		d := newDirect(t, tc.opts...)
		_, ts, err := d.create(t, "key-1", request(100))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := ts.trailer.Get(idemkey.ExpiresMetadata), idemkey.FormatDate(d.clock.Now().Add(tc.retention)); len(got) != 1 || got[0] != want {
			t.Errorf("retention %v: expiry %v, want %s", tc.retention, got, want)
		}
	}
	eng, err := engine.New(memory.New(), engine.WithSingleTenant(), engine.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	for name, opt := range map[string]interceptor.Option{
		"not covered": interceptor.WithMethodRetention(month, getCharge),
		"unknown":     interceptor.WithMethodRetention(month, "CreateCharge"),
		"too short":   interceptor.WithMethodRetention(time.Second, createCharge),
	} {
		if _, err := interceptor.UnaryServerInterceptor(eng, opt); err == nil || !strings.Contains(err.Error(), "WithMethodRetention") {
			t.Errorf("%s: %v, want a refusal naming WithMethodRetention", name, err)
		}
	}
}
