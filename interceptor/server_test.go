package interceptor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

func TestReplay(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	first, ts, err := d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	expires := ts.trailer.Get(idemkey.ExpiresMetadata)
	if len(expires) != 1 {
		t.Fatalf("first reply trailer %v, want the key's expiry", ts.trailer)
	}
	wantMD(t, "first trailer", ts.trailer, metadata.Pairs(idemkey.ReplayedMetadata, "false", idemkey.ExpiresMetadata, expires[0]))
	second, ts, err := d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	wantRuns(t, d.svc, 1)
	if !proto.Equal(first, second) {
		t.Errorf("replay = %v, want %v", second, first)
	}
	wantMD(t, "trailer", ts.trailer, metadata.Pairs(idemkey.ReplayedMetadata, "true", idemkey.ExpiresMetadata, expires[0]))
	if len(ts.header) != 0 {
		t.Errorf("replay set header %v, want none", ts.header)
	}
}

func TestReusedKey(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	if _, _, err := d.create(t, "key-1", request(100)); err != nil {
		t.Fatal(err)
	}
	_, _, err := d.create(t, "key-1", request(999))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)
	wantRuns(t, d.svc, 1)
}

// A retry while the first call runs gets Aborted with pushback and no header;
// a different request under the key gets "reused" even then.
func TestInProgress(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), engine.WithMaxRetryAfter(250*time.Millisecond))
	started, release := d.svc.block()
	done := make(chan error)
	go func() {
		_, _, err := d.create(t, "key-1", request(100))
		done <- err
	}()
	<-started

	_, ts, err := d.create(t, "key-1", request(100))
	wantReason(t, err, codes.Aborted, idemkey.ReasonInProgress)
	if delay, ok := idemkey.RetryDelay(err); !ok || delay != 250*time.Millisecond {
		t.Errorf("RetryInfo delay = %v, %v; want 250ms", delay, ok)
	}
	if got := ts.trailer.Get(interceptor.PushbackMetadata); len(got) != 1 || got[0] != "250" {
		t.Errorf("pushback trailer = %q, want [250]", got)
	}
	if len(ts.header) != 0 {
		t.Errorf("in-progress reply set header %v; a retry policy would not retry it", ts.header)
	}
	_, _, err = d.create(t, "key-1", request(999))
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)

	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, ts, err := d.create(t, "key-1", request(100)); err != nil || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("after the first call ended: err %v, replayed %v; want a replay", err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)))
	}
	wantRuns(t, d.svc, 1)
}

// An attempt that gRPC marks as a retry reads the record first (Find) and
// answers exactly as a first attempt would: a replay, "reused" for another
// request, "in progress" while the first runs, and a run for a key that never
// reached the server. Only a recorded key spares the reservation.
func TestRetriedAttempt(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	st := &countingStore{Store: d.store}
	d.intercept = grpctest.Interceptor(st, engine.WithTenant(tenantFromMetadata), engine.WithInProgressWait(0))
	attempt := func(n, key string, req *paymentsv1.CreateChargeRequest, wantFinds, wantReserves int32) (*paymentsv1.Charge, *transportStream, error) {
		t.Helper()
		resp, ts, err := d.call(context.Background(), createCharge, req,
			idemkey.KeyMetadata, key, "tenant", "acme", interceptor.AttemptsMetadata, n)
		if f, r := st.finds.Swap(0), st.reserves.Swap(0); f != wantFinds || r != wantReserves {
			t.Errorf("attempt %s of %s: %d finds and %d reserves, want %d and %d", n, key, f, r, wantFinds, wantReserves)
		}
		charge, _ := resp.(*paymentsv1.Charge)
		return charge, ts, err
	}
	first, _, err := attempt("0", "done", request(100), 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	replay, ts, err := attempt("1", "done", request(100), 1, 0)
	if err != nil || !proto.Equal(replay, first) || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("retry of a recorded call: %v, %v, replayed %v; want the replay of %v", replay, err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)), first)
	}
	_, _, err = attempt("2", "done", request(999), 1, 0)
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)
	if _, _, err := attempt("1", "lost-before-the-server", request(100), 1, 1); err != nil {
		t.Fatal(err)
	}

	started, release := d.svc.block()
	done := make(chan error)
	go func() {
		_, _, err := d.create(t, "running", request(100))
		done <- err
	}()
	<-started
	st.finds.Store(0)
	st.reserves.Store(0)
	_, _, err = attempt("1", "running", request(100), 1, 1)
	wantReason(t, err, codes.Aborted, idemkey.ReasonInProgress)
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	wantRuns(t, d.svc, 3)
}

// recordedCodes is DESIGN.md's table: these outcomes are final and replayed;
// every other code releases the key.
var recordedCodes = map[codes.Code]bool{
	codes.NotFound: true, codes.AlreadyExists: true, codes.FailedPrecondition: true, codes.OutOfRange: true,
	codes.Unimplemented: true, codes.Internal: true, codes.Unknown: true, codes.DataLoss: true,
}

func TestRecordedAndReleasedCodes(t *testing.T) {
	for code := codes.Canceled; code <= codes.Unauthenticated; code++ {
		t.Run(code.String(), func(t *testing.T) {
			d := newDirect(t, engine.WithTenant(tenantFromMetadata))
			d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
				return nil, statusWithDetails(code)
			}
			_, _, first := d.create(t, "key-1", request(100))
			_, ts, second := d.create(t, "key-1", request(100))
			if !proto.Equal(status.Convert(first).Proto(), status.Convert(second).Proto()) {
				t.Fatalf("second call got %v, want the same status as the first, %v", second, first)
			}
			if recordedCodes[code] {
				wantRuns(t, d.svc, 1)
				if !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
					t.Error("recorded error replayed without the replayed trailer")
				}
			} else {
				wantRuns(t, d.svc, 2)
			}
		})
	}
}

// Errors that are not statuses are classified as gRPC sends them: context
// errors, even wrapped, as Canceled or DeadlineExceeded (released), anything
// else as Unknown (recorded).
func TestPlainErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		code codes.Code
		runs int
	}{
		{"context.Canceled", context.Canceled, codes.Canceled, 2},
		{"wrapped DeadlineExceeded", fmt.Errorf("charge: %w", context.DeadlineExceeded), codes.DeadlineExceeded, 2},
		{"errors.New", errors.New("disk full"), codes.Unknown, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDirect(t)
			d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
				return nil, tc.err
			}
			d.create(t, "key-1", request(1))
			_, _, err := d.create(t, "key-1", request(1))
			wantRuns(t, d.svc, tc.runs)
			if tc.runs == 1 && status.Code(err) != tc.code {
				t.Errorf("replayed code %v, want %v", status.Code(err), tc.code)
			}
		})
	}
}

// A reply that cannot be recorded is recorded as Internal: the handler ran,
// so its key must not be released.
func TestUnrecordableReply(t *testing.T) {
	logger, logs := logtest.New()
	d := newDirect(t, engine.WithLogger(logger))
	d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return &paymentsv1.Charge{Id: "ch_\xff"}, nil // not UTF-8: gRPC cannot marshal it either
	}
	_, _, first := d.create(t, "key-1", request(1))
	_, _, retry := d.create(t, "key-1", request(1))
	if status.Code(first) != codes.Internal || status.Convert(first).Message() != status.Convert(retry).Message() {
		t.Errorf("first call: %v; retry: %v; want the same Internal", first, retry)
	}
	wantRuns(t, d.svc, 1)
	if !strings.Contains(logs.String(), "cannot be recorded") {
		t.Errorf("not logged: %s", logs)
	}
}

// A reply whose record would exceed the cap is answered and recorded as
// Internal, to the first caller as to every retry, and the handler runs once.
func TestReplyTooLarge(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []any
		size int // of the description
	}{
		{"default cap", nil, engine.DefaultMaxRecordSize},
		{"WithMaxRecordSize", []any{engine.WithMaxRecordSize(2000)}, 2000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDirect(t, append(tc.opts, engine.WithLogger(nil))...)
			d.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
				return &paymentsv1.Charge{Id: "ch_1", Description: strings.Repeat("x", int(req.GetAmount()))}, nil
			}
			if _, _, err := d.create(t, "small", request(int64(tc.size/2))); err != nil {
				t.Fatalf("a reply under the cap: %v", err)
			}
			for attempt := range 2 {
				_, ts, err := d.create(t, "large", request(int64(tc.size)))
				if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "too large") {
					t.Errorf("attempt %d of a reply over the cap: %v, want Internal, too large to record", attempt, err)
				}
				if replayed := idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)); replayed != (attempt > 0) {
					t.Errorf("attempt %d: replayed %v", attempt, replayed)
				}
			}
			wantRuns(t, d.svc, 2)
		})
	}
}

// Error messages and binary metadata are replayed byte for byte.
func TestReplayIsExact(t *testing.T) {
	d := newDirect(t, interceptor.WithReplayedMetadata("x-sig-bin"))
	d.svc.create = func(ctx context.Context, _ *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-sig-bin", "\x00\xff\x01"))
		return nil, status.Error(codes.FailedPrecondition, "declined \xff")
	}
	_, _, first := d.create(t, "key-1", request(1))
	_, ts, second := d.create(t, "key-1", request(1))
	wantRuns(t, d.svc, 1)
	if status.Convert(second).Message() != status.Convert(first).Message() {
		t.Errorf("replayed message %q, want %q", status.Convert(second).Message(), status.Convert(first).Message())
	}
	if got := ts.trailer.Get("x-sig-bin"); len(got) != 1 || got[0] != "\x00\xff\x01" {
		t.Errorf("replayed binary trailer %q, want [\\x00\\xff\\x01]", got)
	}
}

// statusWithDetails is an error with a message and details, all of which a
// recorded error must replay whole.
func statusWithDetails(code codes.Code) error {
	st, err := status.New(code, "card declined: insufficient funds").WithDetails(
		&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example", Metadata: map[string]string{"decline_code": "insufficient_funds"}},
		&errdetails.LocalizedMessage{Locale: "en-US", Message: "Your card was declined."})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

func TestRecordedCodesOption(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithRecordedCodes(codes.ResourceExhausted))
	d.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		if req.GetAmount() > 100 {
			return nil, status.Error(codes.NotFound, "not found")
		}
		return nil, status.Error(codes.ResourceExhausted, "limit")
	}
	d.create(t, "a", request(1))
	d.create(t, "a", request(1))
	wantRuns(t, d.svc, 1) // ResourceExhausted is now recorded
	d.create(t, "b", request(500))
	d.create(t, "b", request(500))
	wantRuns(t, d.svc, 3) // NotFound no longer is
}

func TestPanicReleasesKey(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		panic("boom")
	}
	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Errorf("recovered %v, want the handler's panic to propagate", p)
			}
		}()
		d.create(t, "key-1", request(100))
	}()
	d.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return chargeFor(req, 1), nil
	}
	if _, _, err := d.create(t, "key-1", request(100)); err != nil {
		t.Fatalf("retry after a panic: %v; want the handler to run again", err)
	}
	wantRuns(t, d.svc, 2)
}

func TestReplayedMetadata(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithReplayedMetadata("X-Charge-Region", "x-trace-id"))
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-region", "eu-1", "x-internal", "secret"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-trace-id", "t-1", "x-trace-id", "t-2", "x-timing", "3ms"))
		return chargeFor(req, 1), nil
	}
	_, first, err := d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	if got := first.header.Get("x-internal"); len(got) != 1 {
		t.Fatalf("the first call's own header was not passed through: %v", first.header)
	}
	_, replay, err := d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	wantMD(t, "header", replay.header, metadata.Pairs("x-charge-region", "eu-1"))
	wantMD(t, "trailer", replay.trailer, metadata.Pairs("x-trace-id", "t-1", "x-trace-id", "t-2", idemkey.ReplayedMetadata, "true",
		idemkey.ExpiresMetadata, first.trailer.Get(idemkey.ExpiresMetadata)[0]))
}

// A record made while a header was allow-listed replays only what today's
// allow-list names: removing a key from WithReplayedMetadata stops its replay.
func TestReplayedMetadataFollowsTodaysAllowList(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata), interceptor.WithReplayedMetadata("x-charge-region", "set-cookie"))
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-region", "eu-1", "set-cookie", "session=caller-1"))
		return chargeFor(req, 1), nil
	}
	if _, _, err := d.create(t, "key-1", request(100)); err != nil {
		t.Fatal(err)
	}
	d.intercept = grpctest.Interceptor(d.store, engine.WithTenant(tenantFromMetadata), interceptor.WithReplayedMetadata("x-charge-region"))
	_, replay, err := d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	wantMD(t, "header", replay.header, metadata.Pairs("x-charge-region", "eu-1"))
	d.intercept = grpctest.Interceptor(d.store, engine.WithTenant(tenantFromMetadata))
	_, replay, err = d.create(t, "key-1", request(100))
	if err != nil {
		t.Fatal(err)
	}
	wantMD(t, "header", replay.header, nil)
	wantRuns(t, d.svc, 1)
}

func wantMD(t *testing.T, what string, got, want metadata.MD) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("replayed %s = %v, want %v", what, got, want)
		return
	}
	for k, vs := range want {
		if strings.Join(got[k], ",") != strings.Join(vs, ",") {
			t.Errorf("replayed %s = %v, want %v", what, got, want)
		}
	}
}

// Every malformed key is refused with InvalidArgument before the store or
// the handler is touched.
func TestBadKeys(t *testing.T) {
	for name, pairs := range map[string][]string{
		"empty":          {idemkey.KeyMetadata, ""},
		"256 bytes":      {idemkey.KeyMetadata, strings.Repeat("k", 256)},
		"64 KiB":         {idemkey.KeyMetadata, strings.Repeat("k", 64<<10)},
		"space":          {idemkey.KeyMetadata, "sp ace"},
		"control byte":   {idemkey.KeyMetadata, "a\x01b"},
		"DEL":            {idemkey.KeyMetadata, "a\x7fb"},
		"non-ASCII":      {idemkey.KeyMetadata, "clé"},
		"newline":        {idemkey.KeyMetadata, "a\nb"},
		"two values":     {idemkey.KeyMetadata, "a", idemkey.KeyMetadata, "b"},
		"binary":         {idemkey.KeyMetadata + "-bin", "abc"},
		"binary and key": {idemkey.KeyMetadata, "abc", idemkey.KeyMetadata + "-bin", "abc"},
	} {
		t.Run(name, func(t *testing.T) {
			d := newDirect(t, engine.WithTenant(tenantFromMetadata))
			_, _, err := d.call(context.Background(), createCharge, request(100), append(pairs, "tenant", "acme")...)
			wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyInvalid)
			wantRuns(t, d.svc, 0)
			if n := d.store.Len(); n != 0 {
				t.Errorf("the store holds %d records, want 0", n)
			}
			if len(pairs[1]) >= 3 && strings.Contains(status.Convert(err).Message(), pairs[1]) {
				t.Errorf("the error quotes the key: %v", err)
			}
		})
	}
	// The longest valid key is accepted.
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	if _, _, err := d.create(t, strings.Repeat("~", idemkey.MaxKeyLen), request(1)); err != nil {
		t.Errorf("a %d-byte key: %v", idemkey.MaxKeyLen, err)
	}
}

func TestMissingKey(t *testing.T) {
	optional := newDirect(t, engine.WithTenant(tenantFromMetadata))
	if _, _, err := optional.call(context.Background(), createCharge, request(1), "tenant", "acme"); err != nil {
		t.Fatalf("no key, key optional: %v", err)
	}
	wantRuns(t, optional.svc, 1)
	if n := optional.store.Len(); n != 0 {
		t.Errorf("a call without a key left %d records", n)
	}

	required := newDirect(t, engine.WithTenant(tenantFromMetadata), engine.WithKeyRequired())
	_, _, err := required.call(context.Background(), createCharge, request(1), "tenant", "acme")
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyMissing)
	wantRuns(t, required.svc, 0)
}

func TestMethodCoverage(t *testing.T) {
	get := &paymentsv1.GetChargeRequest{Id: "ch_1"}
	// GetCharge is NO_SIDE_EFFECTS: untouched, even with a key, which the
	// answer says it ignored; without one, it says nothing.
	d := newDirect(t, engine.WithKeyRequired())
	for range 2 {
		if _, ts, err := d.call(context.Background(), getCharge, get, idemkey.KeyMetadata, "k"); err != nil || !idemkey.ParseIgnored(ts.trailer.Get(idemkey.StatusMetadata)) ||
			len(ts.trailer.Get(idemkey.ReplayedMetadata)) != 0 {
			t.Fatalf("GetCharge: err %v, trailer %v; want it marked %s: %s alone", err, ts.trailer, idemkey.StatusMetadata, idemkey.StatusIgnored)
		}
	}
	if _, ts, err := d.call(context.Background(), getCharge, get); err != nil || len(ts.trailer) != 0 {
		t.Fatalf("GetCharge without a key: err %v, trailer %v; want none", err, ts.trailer)
	}
	wantRuns(t, d.svc, 3)

	// Included by name, it is covered.
	d = newDirect(t, interceptor.WithIncludedMethods(getCharge))
	d.call(context.Background(), getCharge, get, idemkey.KeyMetadata, "k")
	if _, ts, _ := d.call(context.Background(), getCharge, get, idemkey.KeyMetadata, "k"); !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Error("an included method was not replayed")
	}
	wantRuns(t, d.svc, 1)

	// gRPC's own services, such as health, are never covered by default.
	health := func(context.Context, any) (any, error) { return &healthpb.HealthCheckResponse{}, nil }
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idemkey.KeyMetadata, "k"))
	for range 2 {
		_, err := d.intercept(ctx, &healthpb.HealthCheckRequest{}, &grpc.UnaryServerInfo{FullMethod: "/grpc.health.v1.Health/Check"}, health)
		if err != nil {
			t.Fatalf("health check: %v", err)
		}
	}
	if n := d.store.Len(); n != 1 {
		t.Errorf("the store holds %d records, want only GetCharge's", n)
	}
	// Included by name, even a gRPC service method is covered.
	d = newDirect(t, interceptor.WithIncludedMethods("/grpc.health.v1.Health/Check"))
	for range 2 {
		if _, err := d.intercept(ctx, &healthpb.HealthCheckRequest{}, &grpc.UnaryServerInfo{FullMethod: "/grpc.health.v1.Health/Check"}, health); err != nil {
			t.Fatalf("included health check: %v", err)
		}
	}
	if n := d.store.Len(); n != 1 {
		t.Errorf("included health check left %d records, want 1", n)
	}

	// Excluded, CreateCharge is not, key or no key.
	d = newDirect(t, interceptor.WithExcludedMethods(createCharge), engine.WithKeyRequired())
	d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
	d.call(context.Background(), createCharge, request(1))
	wantRuns(t, d.svc, 2)
}

func TestTenantsAreIsolated(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	for _, tenant := range []string{"acme", "globex", "acme"} {
		if _, _, err := d.call(context.Background(), createCharge, request(100), idemkey.KeyMetadata, "shared", "tenant", tenant); err != nil {
			t.Fatal(err)
		}
	}
	wantRuns(t, d.svc, 2)

	_, _, err := d.call(context.Background(), createCharge, request(100), idemkey.KeyMetadata, "shared")
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("tenant function error: got %v, want it returned unchanged", err)
	}
}

func TestScopeTenant(t *testing.T) {
	d := newDirect(t, engine.WithScope(engine.ScopeTenant), interceptor.WithIncludedMethods(getCharge))
	if _, _, err := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k"); err != nil {
		t.Fatal(err)
	}
	_, _, err := d.call(context.Background(), getCharge, &paymentsv1.GetChargeRequest{}, idemkey.KeyMetadata, "k")
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)

	// Even a fingerprint that leaves the method out cannot replay one
	// method's reply to another.
	sameForAll := func(string, proto.Message) (store.Fingerprint, error) { return store.Fingerprint{}, nil }
	d = newDirect(t, engine.WithScope(engine.ScopeTenant), interceptor.WithIncludedMethods(getCharge), interceptor.WithFingerprint(sameForAll))
	d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
	_, _, err = d.call(context.Background(), getCharge, &paymentsv1.GetChargeRequest{}, idemkey.KeyMetadata, "k")
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)

	// The default scope keeps methods apart.
	d = newDirect(t, interceptor.WithIncludedMethods(getCharge))
	d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
	if _, _, err := d.call(context.Background(), getCharge, &paymentsv1.GetChargeRequest{}, idemkey.KeyMetadata, "k"); err != nil {
		t.Errorf("same key on another method: %v", err)
	}
}

// A custom fingerprint can leave out a field that changes on every attempt.
func TestCustomFingerprint(t *testing.T) {
	ignoreDescription := func(method string, req proto.Message) (store.Fingerprint, error) {
		r := proto.Clone(req).(*paymentsv1.CreateChargeRequest)
		r.Description = ""
		return protokey.HashRequest(method, r)
	}
	d := newDirect(t, interceptor.WithFingerprint(ignoreDescription))
	a, b := request(100), request(100)
	a.Description, b.Description = "sent at 10:00", "sent at 10:01"
	d.call(context.Background(), createCharge, a, idemkey.KeyMetadata, "k")
	if _, ts, err := d.call(context.Background(), createCharge, b, idemkey.KeyMetadata, "k"); err != nil || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("second attempt: err %v, replayed %v; want a replay", err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)))
	}
	c := request(200)
	_, _, err := d.call(context.Background(), createCharge, c, idemkey.KeyMetadata, "k")
	wantReason(t, err, codes.InvalidArgument, idemkey.ReasonKeyReused)

	logger, _ := logtest.New()
	failing := newDirect(t, engine.WithLogger(logger), interceptor.WithFingerprint(func(string, proto.Message) (store.Fingerprint, error) {
		return store.Fingerprint{}, errors.New("cannot hash")
	}))
	_, _, err = failing.call(context.Background(), createCharge, a, idemkey.KeyMetadata, "k")
	if status.Code(err) != codes.Internal {
		t.Errorf("fingerprint error: code %v, want Internal", status.Code(err))
	}
	wantRuns(t, failing.svc, 0)
}

// A store that fails answers Unavailable, or with WithFailOpen runs the
// handler. A first attempt asks Reserve. A retry asks Find, and failing
// closed answers at once rather than wait on the store twice; failing open,
// it tries Reserve before it runs the handler unprotected.
func TestStoreUnavailable(t *testing.T) {
	logger, logs := logtest.New()
	svc := newService()
	for _, retry := range []bool{false, true} {
		pairs := []string{idemkey.KeyMetadata, "secret-key-123", "tenant", "tenant-acme"}
		if retry {
			pairs = append(pairs, interceptor.AttemptsMetadata, "1")
		}
		call := func(wantFinds, wantReserves int32, opts ...any) error {
			t.Helper()
			st := &countingStore{Store: failingStore{}}
			intercept := grpctest.Interceptor(st, append(opts, engine.WithLogger(logger), engine.WithTenant(tenantFromMetadata))...)
			ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(pairs...))
			_, err := intercept(ctx, request(100), &grpc.UnaryServerInfo{FullMethod: createCharge}, svc.handler())
			if f, r := st.finds.Load(), st.reserves.Load(); f != wantFinds || r != wantReserves {
				t.Errorf("retry %v, %d options: %d finds and %d reserves, want %d and %d", retry, len(opts), f, r, wantFinds, wantReserves)
			}
			return err
		}
		finds, reserves := int32(0), int32(1)
		if retry {
			finds, reserves = 1, 0
		}
		runs := int(svc.runs.Load())
		wantReason(t, call(finds, reserves), codes.Unavailable, idemkey.ReasonStoreUnavailable)
		wantRuns(t, svc, runs)

		if err := call(finds, 1, engine.WithFailOpen()); err != nil {
			t.Fatalf("retry %v, fail-open: %v", retry, err)
		}
		wantRuns(t, svc, runs+1)
	}

	out := logs.String()
	if !strings.Contains(out, "reserve failed") || !strings.Contains(out, "find failed") {
		t.Errorf("store failure not logged: %q", out)
	}
	for _, secret := range []string{"secret-key-123", "tenant-acme", "cus_1"} {
		if strings.Contains(out, secret) {
			t.Errorf("log holds %q: %s", secret, out)
		}
	}
}

// A client that hangs up mid-handler must not leave its key in progress: the
// record is written with a context detached from the call.
func TestCanceledCallStillRecords(t *testing.T) {
	d := newDirect(t)
	ctx, cancel := context.WithCancel(context.Background())
	d.svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		cancel() // the client goes away after the charge is made
		return chargeFor(req, 1), nil
	}
	if _, _, err := d.call(ctx, createCharge, request(1), idemkey.KeyMetadata, "k"); err != nil {
		t.Fatal(err)
	}
	if _, ts, err := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k"); err != nil || !idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)) {
		t.Errorf("retry: err %v, replayed %v; want the recorded reply", err, idemkey.ParseReplayed(ts.trailer.Get(idemkey.ReplayedMetadata)))
	}
	wantRuns(t, d.svc, 1)
}

func TestLeaseFollowsDeadline(t *testing.T) {
	for _, tc := range []struct {
		name     string
		timeout  time.Duration // 0: no deadline
		lease    []any
		min, max time.Duration
	}{
		{"no deadline", 0, nil, engine.DefaultLease - time.Second, engine.DefaultLease},
		{"2s deadline", 2 * time.Second, nil, 6 * time.Second, 7 * time.Second},
		{"long deadline", time.Hour, nil, engine.DefaultMaxLease - time.Second, engine.DefaultMaxLease},
		{"default above max", 0, []any{engine.WithLease(time.Hour), engine.WithMaxLease(2 * time.Minute)}, 2*time.Minute - time.Second, 2 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := []any{engine.WithMaxRetryAfter(time.Hour)}
			opts = append(opts, tc.lease...)
			d := newDirect(t, opts...)
			started, release := d.svc.block()
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if tc.timeout > 0 {
				ctx, cancel = context.WithTimeout(ctx, tc.timeout)
			}
			defer cancel()
			done := make(chan struct{})
			go func() {
				defer close(done)
				d.call(ctx, createCharge, request(1), idemkey.KeyMetadata, "k")
			}()
			<-started
			_, _, err := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
			close(release)
			<-done
			delay, _ := idemkey.RetryDelay(err)
			if delay < tc.min || delay > tc.max {
				t.Errorf("lease left = %v, want in [%v, %v]", delay, tc.min, tc.max)
			}
		})
	}
}

func TestCorruptRecord(t *testing.T) {
	logger, logs := logtest.New()
	d := newDirect(t, engine.WithLogger(logger))
	fp, err := protokey.HashRequest(createCharge, request(1))
	if err != nil {
		t.Fatal(err)
	}
	for i, raw := range [][]byte{
		{0xff, 0xff, 0xff},         // not protobuf
		{0x0a, 0x05, 0x01},         // truncated response field
		{0x0a, 0x02, 0xff, 0xff},   // a response that is not a Charge
		{0x12, 0x02, 0x08, 0x00},   // an error with code OK
		{},                         // neither response nor error
		[]byte("\x22\x03\x0a\x01"), // truncated header entry
	} {
		key := "corrupt-" + string(rune('a'+i))
		res, err := d.store.Reserve(context.Background(), store.Reservation{
			Key: store.ScopeKey("", createCharge, key), Fingerprint: fp, Lease: time.Minute, Retention: time.Hour})
		if err != nil || res.State != store.Acquired {
			t.Fatalf("Reserve: %v, %v", res.State, err)
		}
		if err := d.store.Complete(context.Background(), store.ScopeKey("", createCharge, key), res.Token, raw); err != nil {
			t.Fatal(err)
		}
		_, _, err = d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, key)
		if status.Code(err) != codes.Internal {
			t.Errorf("record %x: code %v, want Internal", raw, status.Code(err))
		}
	}
	wantRuns(t, d.svc, 0)
	if !strings.Contains(logs.String(), "corrupt") {
		t.Errorf("corrupt records not logged: %s", logs)
	}
}

// When the lease is taken over mid-handler, the first caller still gets its
// own result, the record keeps the new holder's, and the loss is logged.
func TestLeaseLostIsLogged(t *testing.T) {
	logger, logs := logtest.New()
	d := newDirect(t, engine.WithLogger(logger))
	nested := false
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		if !nested {
			nested = true
			d.clock.Advance(t, engine.DefaultLease+time.Second) // the lease ends; a retry takes over
			if _, _, err := d.call(context.Background(), createCharge, req, idemkey.KeyMetadata, "k"); err != nil {
				return nil, err
			}
			return &paymentsv1.Charge{Id: "ch_first"}, nil
		}
		return &paymentsv1.Charge{Id: "ch_takeover"}, nil
	}
	first, _, err := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
	if err != nil || first.(*paymentsv1.Charge).GetId() != "ch_first" {
		t.Fatalf("first caller got %v, %v; want its own reply", first, err)
	}
	replay, _, _ := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, "k")
	if replay.(*paymentsv1.Charge).GetId() != "ch_takeover" {
		t.Errorf("replay = %v, want the reply recorded by the holder that took over", replay)
	}
	if !strings.Contains(logs.String(), "lease was taken over") {
		t.Errorf("lost lease not logged: %s", logs)
	}
}

// Every path that logs keeps the key, the tenant and the request out of the
// log and out of the errors it returns.
func TestNoSecretsInLogsOrErrors(t *testing.T) {
	const key, tenant, customer = "SECRET-KEY-7f3a", "SECRET-TENANT-acme", "SECRET-CUSTOMER-42"
	req := &paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 1, Currency: "EUR"}
	logger, logs := logtest.New()
	d := newDirect(t, engine.WithLogger(logger), engine.WithTenant(tenantFromMetadata))
	call := func(k string) error {
		_, _, err := d.call(context.Background(), createCharge, req, idemkey.KeyMetadata, k, "tenant", tenant)
		return err
	}
	var errs []error

	// A reply that cannot be recorded.
	d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		return &paymentsv1.Charge{Id: "\xff"}, nil
	}
	errs = append(errs, call(key+"-1"), call(key+"-1"))

	// A lease lost to a takeover.
	taken := false
	d.svc.create = func(_ context.Context, r *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		if !taken {
			taken = true
			d.clock.Advance(t, engine.DefaultLease+time.Second)
			errs = append(errs, call(key+"-2"))
		}
		return chargeFor(r, 1), nil
	}
	errs = append(errs, call(key+"-2"))

	// A corrupt record.
	fp, _ := protokey.HashRequest(createCharge, req)
	scope := store.ScopeKey(tenant, createCharge, key+"-3")
	res, _ := d.store.Reserve(context.Background(), store.Reservation{Key: scope, Fingerprint: fp, Lease: time.Minute, Retention: time.Hour})
	_ = d.store.Complete(context.Background(), scope, res.Token, []byte{0xff})
	errs = append(errs, call(key+"-3"))

	// Bad and reused keys.
	errs = append(errs, call(key+" with a space"), call(""))
	req.Amount = 2
	errs = append(errs, call(key+"-1"))

	out := logs.String()
	for _, want := range []string{"cannot be recorded", "lease was taken over", "corrupt"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q: %s", want, out)
		}
	}
	for _, secret := range []string{"SECRET-KEY", "SECRET-TENANT", "SECRET-CUSTOMER"} {
		if strings.Contains(out, secret) {
			t.Errorf("log holds %s: %s", secret, out)
		}
		for _, err := range errs {
			if err != nil && strings.Contains(err.Error(), secret) {
				t.Errorf("error holds %s: %v", secret, err)
			}
		}
	}
}

// A nil logger discards the records rather than break the server. (Zero
// durations are refused by engine.New: see the engine's tests.)
func TestNilLogger(t *testing.T) {
	d := newDirect(t, engine.WithLogger(nil))
	intercept := grpctest.Interceptor(failingStore{}, engine.WithLogger(nil))
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idemkey.KeyMetadata, "k"))
	_, err := intercept(ctx, request(1), &grpc.UnaryServerInfo{FullMethod: createCharge}, d.svc.handler())
	wantReason(t, err, codes.Unavailable, idemkey.ReasonStoreUnavailable)
}

// Inside the handler, DerivedKey gives the key derived from the call's
// tenant, method and key: the same on a retry that runs the handler again.
func TestDerivedKey(t *testing.T) {
	d := newDirect(t, engine.WithTenant(tenantFromMetadata))
	var derived []string
	d.svc.create = func(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		k, ok := idemkey.DerivedKey(ctx, "provider")
		if !ok {
			t.Error("DerivedKey in the handler: not ok")
		}
		derived = append(derived, k)
		return nil, status.Error(codes.Unavailable, "released, so the retry runs again")
	}
	for range 2 {
		d.create(t, "k-1", request(1))
	}
	want := idemkey.DeriveKey("acme", createCharge, "k-1", "provider")
	if len(derived) != 2 || derived[0] != want || derived[1] != want {
		t.Errorf("derived keys of a call and its retry: %q, want %q twice", derived, want)
	}
	if _, ok := idemkey.DerivedKey(context.Background(), "provider"); ok {
		t.Error("DerivedKey outside a call: ok")
	}
}
