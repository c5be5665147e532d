package interceptor_test

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func TestE2EReplayIsByteIdentical(t *testing.T) {
	e := newE2E(t)
	codec := newRawCodec()
	ctx := withKey(context.Background(), "key-1")
	var trailer metadata.MD

	first, err := e.plain.CreateCharge(ctx, request(100), grpc.ForceCodecV2(codec), grpc.Trailer(&trailer))
	if err != nil {
		t.Fatal(err)
	}
	firstBytes := codec.lastBytes()
	if idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Error("the first reply is marked replayed")
	}
	second, err := e.plain.CreateCharge(ctx, request(100), grpc.ForceCodecV2(codec), grpc.Trailer(&trailer))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(firstBytes, codec.lastBytes()) || len(firstBytes) == 0 {
		t.Errorf("replayed reply bytes %x differ from the first reply's %x", codec.lastBytes(), firstBytes)
	}
	if !proto.Equal(first, second) {
		t.Errorf("replay = %v, want %v", second, first)
	}
	if !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("replay trailer = %v, want %s: true", trailer, idemkey.ReplayedMetadata)
	}
	wantRuns(t, e.svc, 1)
}

func TestE2EReusedKey(t *testing.T) {
	e := newE2E(t)
	started, release := e.svc.block()
	ctx := withKey(context.Background(), "key-1")
	done := make(chan error)
	go func() {
		_, err := e.plain.CreateCharge(ctx, request(100))
		done <- err
	}()
	<-started
	_, err := e.plain.CreateCharge(ctx, request(200))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused) // in progress

	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	_, err = e.plain.CreateCharge(ctx, request(200))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused) // completed
	wantRuns(t, e.svc, 1)
}

// A duplicate that arrives while the first call runs is answered Aborted,
// trailers only, with pushback; the client's retry policy then brings it the
// first call's reply.
func TestE2EDuplicateConvergesThroughRetry(t *testing.T) {
	e := newE2E(t, engine.WithMaxRetryAfter(20*time.Millisecond))
	started, release := e.svc.block()
	ctx := withKey(context.Background(), "key-1")
	type result struct {
		charge  *paymentsv1.Charge
		trailer metadata.MD
		err     error
	}
	call := func(client paymentsv1.PaymentServiceClient) <-chan result {
		ch := make(chan result, 1)
		go func() {
			var r result
			r.charge, r.err = client.CreateCharge(ctx, request(100), grpc.Trailer(&r.trailer))
			ch <- r
		}()
		return ch
	}
	first := call(e.client)
	<-started

	// Without retries, the duplicate sees the Aborted answer itself.
	var header, trailer metadata.MD
	_, err := e.plain.CreateCharge(ctx, request(100), grpc.Header(&header), grpc.Trailer(&trailer))
	wantReason(t, err, codes.Aborted, idemkey.ReasonInProgress)
	if got := trailer.Get(interceptor.PushbackMetadata); len(got) != 1 || got[0] != "20" {
		t.Errorf("pushback trailer = %q, want [20]", got)
	}
	if delay, ok := idemkey.RetryDelay(err); !ok || delay != 20*time.Millisecond {
		t.Errorf("RetryInfo = %v, %v; want 20ms", delay, ok)
	}
	if len(header) != 0 {
		t.Errorf("Aborted reply carried header %v; it must be trailers-only", header)
	}
	waitFor(t, e.aborted, "the plain duplicate's Aborted")

	// With the retry policy, the duplicate is retried until the first ends.
	duplicate := call(e.client)
	waitFor(t, e.aborted, "an attempt of the retried duplicate to be Aborted")
	close(release)
	a, b := <-first, <-duplicate
	if a.err != nil || b.err != nil {
		t.Fatalf("first: %v, duplicate: %v", a.err, b.err)
	}
	if !proto.Equal(a.charge, b.charge) {
		t.Errorf("duplicate got %v, want the first reply %v", b.charge, a.charge)
	}
	if !idemkey.ParseReplayed(b.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Error("the duplicate's reply is not marked replayed")
	}
	wantRuns(t, e.svc, 1)
}

func TestE2ECodes(t *testing.T) {
	e := newE2E(t)
	for code := codes.Canceled; code <= codes.Unauthenticated; code++ {
		e.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
			return nil, statusWithDetails(code)
		}
		e.svc.runs.Store(0)
		ctx := withKey(context.Background(), "key-"+code.String())
		var trailer metadata.MD
		_, first := e.plain.CreateCharge(ctx, request(100))
		_, second := e.plain.CreateCharge(ctx, request(100), grpc.Trailer(&trailer))
		if !proto.Equal(status.Convert(first).Proto(), status.Convert(second).Proto()) {
			t.Errorf("%v: second call got %v, want %v", code, second, first)
		}
		wantRuns := 2
		if recordedCodes[code] {
			wantRuns = 1
		}
		if got := int(e.svc.runs.Load()); got != wantRuns || idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) != (wantRuns == 1) {
			t.Errorf("%v: the handler ran %d times (replayed %v), want %d", code, got, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), wantRuns)
		}
	}
}

func TestE2EPanicReleasesKey(t *testing.T) {
	e := newE2E(t)
	e.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		panic("boom")
	}
	ctx := withKey(context.Background(), "key-1")
	if _, err := e.plain.CreateCharge(ctx, request(100)); status.Code(err) != codes.Internal {
		t.Fatalf("panicking handler: %v, want Internal from the recovery interceptor", err)
	}
	e.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return chargeFor(req, 1), nil
	}
	if _, err := e.plain.CreateCharge(ctx, request(100)); err != nil {
		t.Fatalf("retry after the panic: %v", err)
	}
	wantRuns(t, e.svc, 2)
}

func TestE2EReplayedMetadata(t *testing.T) {
	e := newE2E(t, interceptor.WithReplayedMetadata("x-charge-region", "x-trace-id"))
	e.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-region", "eu-1", "x-internal", "secret"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-trace-id", "t-1", "x-timing", "3ms"))
		return chargeFor(req, 1), nil
	}
	ctx := withKey(context.Background(), "key-1")
	var header, trailer metadata.MD
	for i := range 2 {
		if _, err := e.plain.CreateCharge(ctx, request(100), grpc.Header(&header), grpc.Trailer(&trailer)); err != nil {
			t.Fatal(err)
		}
		if got := header.Get("x-charge-region"); len(got) != 1 || got[0] != "eu-1" {
			t.Errorf("call %d: header x-charge-region = %q, want [eu-1]", i+1, got)
		}
		if got := trailer.Get("x-trace-id"); len(got) != 1 || got[0] != "t-1" {
			t.Errorf("call %d: trailer x-trace-id = %q, want [t-1]", i+1, got)
		}
	}
	if len(header.Get("x-internal")) != 0 || len(trailer.Get("x-timing")) != 0 {
		t.Errorf("replay carried metadata off the allow-list: header %v, trailer %v", header, trailer)
	}
	wantRuns(t, e.svc, 1)
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// The client interceptor makes one key per call, and the retry policy resends
// it on every attempt.
func TestE2EClientKeyPerCall(t *testing.T) {
	e := newE2E(t)
	e.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		if e.svc.runs.Load()%3 != 0 {
			return nil, status.Error(codes.Unavailable, "try again") // released, so retried
		}
		return chargeFor(req, 1), nil
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "acme")
	var seen []string
	for call := range 2 {
		if _, err := e.client.CreateCharge(ctx, request(100)); err != nil {
			t.Fatalf("call %d: %v", call+1, err)
		}
		attempts := drain(e.keys)
		if len(attempts) != 3 {
			t.Fatalf("call %d reached the server %d times, want 3 attempts", call+1, len(attempts))
		}
		for _, k := range attempts {
			if k != attempts[0] {
				t.Errorf("call %d: attempts carried keys %q, want one key", call+1, attempts)
			}
		}
		if !uuidV4.MatchString(attempts[0]) {
			t.Errorf("generated key %q is not a version 4 UUID", attempts[0])
		}
		seen = append(seen, attempts[0])
	}
	if seen[0] == seen[1] {
		t.Errorf("two calls shared the key %q", seen[0])
	}
}

func drain(ch <-chan string) []string {
	var out []string
	for {
		select {
		case s := <-ch:
			out = append(out, s)
		default:
			return out
		}
	}
}

// Spaces around a key's value in metadata are dropped, as idemkey.ParseKey
// drops them on every entry point: the value names the key it surrounds,
// bare or quoted. (grpc-go's client refuses a horizontal tab in metadata,
// which TestKeyFromMetadata reads.)
func TestE2EKeyWithSpacesAround(t *testing.T) {
	e := newE2E(t)
	var first *paymentsv1.Charge
	for i, v := range []string{"k1", " k1", "k1  ", ` "k1" `} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), idemkey.KeyMetadata, v, "tenant", "acme")
		var trailer metadata.MD
		got, err := e.plain.CreateCharge(ctx, request(100), grpc.Trailer(&trailer))
		if err != nil {
			t.Fatalf("key %q: %v", v, err)
		}
		if i == 0 {
			first = got
		} else if !proto.Equal(got, first) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
			t.Errorf("key %q: %v, want the reply of key k1, replayed", v, got)
		}
	}
	wantRuns(t, e.svc, 1)
}

func TestE2EBadKeys(t *testing.T) {
	e := newE2E(t)
	for name, pairs := range map[string][]string{
		"empty":      {idemkey.KeyMetadata, ""},
		"256 bytes":  {idemkey.KeyMetadata, strings.Repeat("k", 256)},
		"64 KiB":     {idemkey.KeyMetadata, strings.Repeat("k", 64<<10)},
		"space":      {idemkey.KeyMetadata, "sp ace"},
		"two values": {idemkey.KeyMetadata, "a", idemkey.KeyMetadata, "b"},
		"binary":     {idemkey.KeyMetadata + "-bin", "\x00\x01"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), append(pairs, "tenant", "acme")...)
		_, err := e.plain.CreateCharge(ctx, request(100))
		if status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyInvalid {
			t.Errorf("%s: got %v, want InvalidArgument %s", name, err, idemkey.ReasonKeyInvalid)
		}
	}
	wantRuns(t, e.svc, 0)
	if n := e.store.Len(); n != 0 {
		t.Errorf("bad keys left %d records", n)
	}
}

// A call without a key that grpc-gateway forwarded (its metadata holds the
// grpcgateway- keys of the HTTP request's permanent headers) is told that
// the gateway needs idemgateway's options to forward the Idempotency-Key
// header; any other is told to set the metadata.
func TestE2EMissingKeyThroughGateway(t *testing.T) {
	e := newE2E(t, engine.WithKeyRequired())
	for _, tc := range []struct {
		name  string
		pairs []string
		names string
	}{
		{"gRPC", nil, "set the " + idemkey.KeyMetadata + " metadata"},
		{"grpc-gateway", []string{"grpcgateway-user-agent", "curl/8.5.0", "x-forwarded-for", "192.0.2.1"}, "idemgateway.ServeMuxOptions"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), append(tc.pairs, "tenant", "acme")...)
		_, err := e.plain.CreateCharge(ctx, request(100))
		if status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyMissing || !strings.Contains(status.Convert(err).Message(), tc.names) {
			t.Errorf("%s: %v; want InvalidArgument %s naming %q", tc.name, err, idemkey.ReasonKeyMissing, tc.names)
		}
	}
	wantRuns(t, e.svc, 0)
}
