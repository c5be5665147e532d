package engine

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

type tenantKey struct{}

// lookupEngine is an engine on st whose tenant is the context's
// tenantKey, with a log, and its operation.
func lookupEngine(t *testing.T, st store.Store, opts ...Option) (*Engine, *Operation, *logtest.Buffer) {
	t.Helper()
	var logs *logtest.Buffer
	tenantOf := func(ctx context.Context) (string, error) {
		if tenant, ok := ctx.Value(tenantKey{}).(string); ok {
			return tenant, nil
		}
		return "", errNoCaller
	}
	e, err := New(st, append([]Option{WithLogger(newLogger(t, &logs)), WithTenant(tenantOf), WithRetention(time.Hour)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	return e, op, logs
}

var errNoCaller = errors.New("no caller")

func asTenant(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantKey{}, tenant)
}

func mustLookup(t *testing.T, e *Engine, ctx context.Context, op *Operation, key string, firstSent time.Time) KeyState {
	t.Helper()
	var values []string // the transport's field: none for the zero time
	if !firstSent.IsZero() {
		values = []string{idemkey.FormatDate(firstSent)}
	}
	ks, err := e.Lookup(ctx, op, key, values)
	if err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	return ks
}

// TestLookup follows a key through its states as its client sees them: unknown,
// in progress with its finished steps, completed with the reply a retry
// gets, and then the same key is unknown to another tenant.
func TestLookup(t *testing.T) {
	e, op, logs := lookupEngine(t, memory.New())
	ctx := asTenant(t.Context(), "tenant-a")
	const key = "key-lookup-1"
	if ks := mustLookup(t, e, ctx, op, key, time.Time{}); ks.State != KeyUnknown || ks.Outcome != nil || !ks.Expires.IsZero() {
		t.Fatalf("Lookup of a new key = %+v; want unknown, nothing else", ks)
	}

	charged, release := make(chan struct{}), make(chan struct{})
	x := &stepCall{key: key, request: "r1", run: func(ctx context.Context) error {
		if _, err := Step(ctx, "charge", func(context.Context) (string, error) { return "ch_1", nil }, nil); err != nil {
			return err
		}
		close(charged)
		<-release
		return nil
	}}
	served := make(chan struct{})
	go func() { defer close(served); e.Serve(ctx, op, x) }()
	<-charged
	ks := mustLookup(t, e, ctx, op, key, time.Now())
	if ks.State != KeyInProgress || !slices.Equal(ks.StepsDone, []string{"charge"}) || ks.Expires.IsZero() {
		t.Errorf("Lookup of a running key = %+v; want in progress, steps [charge], an expiry", ks)
	}
	if ks.RetryAfter <= 0 || ks.RetryAfter > DefaultMaxRetryAfter {
		t.Errorf("Lookup of a running key: RetryAfter %v, want within (0, %v]", ks.RetryAfter, DefaultMaxRetryAfter)
	}
	running := ks.Expires
	close(release)
	<-served
	if x.answer.Verdict != Executed {
		t.Fatalf("the call: %v, want executed", x.answer.Verdict)
	}

	ks = mustLookup(t, e, ctx, op, key, time.Now().Add(-2*time.Hour)) // a record wins over a stale first-sent time
	if ks.State != KeyCompleted || string(ks.Outcome) != "done" || !ks.Expires.Equal(running) || !slices.Equal(ks.StepsDone, []string{"charge"}) {
		t.Errorf("Lookup of a completed key = %+v; want completed, %q, expiry %v, steps [charge]", ks, "done", running)
	}
	retry := &stepCall{key: key, request: "r1", run: func(context.Context) error { t.Error("the retry ran"); return nil }}
	e.Serve(ctx, op, retry)
	if retry.answer.Verdict != Replayed || !bytes.Equal(retry.answer.Outcome, ks.Outcome) || !retry.answer.Expires.Equal(ks.Expires) {
		t.Errorf("a retry: %v, %q, %v; want what Lookup told: replayed, %q, %v", retry.answer.Verdict, retry.answer.Outcome, retry.answer.Expires, ks.Outcome, ks.Expires)
	}

	if ks := mustLookup(t, e, asTenant(t.Context(), "tenant-b"), op, key, time.Time{}); ks.State != KeyUnknown || ks.Outcome != nil || ks.StepsDone != nil {
		t.Errorf("Lookup of tenant a's key by tenant b = %+v; want unknown, nothing else", ks)
	}
	other, err := e.Operation(OperationSpec{Name: "/test.v1.Payments/Refund"})
	if err != nil {
		t.Fatal(err)
	}
	if ks := mustLookup(t, e, ctx, other, key, time.Time{}); ks.State != KeyUnknown {
		t.Errorf("Lookup of the key on another operation = %v; want unknown", ks.State)
	}
	if strings.Contains(logs.String(), key) || strings.Contains(logs.String(), "tenant-") {
		t.Errorf("the log holds the raw key or tenant:\n%s", logs)
	}
}

// TestLookupExpired: a key with no record, first sent longer ago than the
// retention less the clock skew, is expired, as a retry of it would be
// refused; one first sent beyond the skew in the future is refused.
func TestLookupExpired(t *testing.T) {
	e, op, _ := lookupEngine(t, memory.New(), WithClockSkew(time.Minute))
	ctx := asTenant(t.Context(), "tenant-a")
	for _, tc := range []struct {
		name string
		age  time.Duration
		want KeyStatus
	}{
		{"not told", 0, KeyUnknown},
		{"recently", time.Minute, KeyUnknown},
		{"within the skew of the retention", time.Hour - 30*time.Second, KeyExpired},
		{"longer ago than the retention", 2 * time.Hour, KeyExpired},
	} {
		var firstSent time.Time
		if tc.age > 0 {
			firstSent = time.Now().Add(-tc.age)
		}
		if ks := mustLookup(t, e, ctx, op, "key-expired", firstSent); ks.State != tc.want {
			t.Errorf("first sent %s: %v, want %v", tc.name, ks.State, tc.want)
		}
		if tc.want == KeyExpired {
			// A call's own verdict agrees.
			c := e.newCall(op)
			c.start(ctx, request{Tenant: "tenant-a", Key: "key-expired-" + tc.name, Fingerprint: fingerprint("r"), FirstSent: firstSent})
			if c.Verdict != Expired {
				t.Errorf("first sent %s: a call's verdict %v, want expired", tc.name, c.Verdict)
			}
		}
	}
	_, err := e.Lookup(ctx, op, "key-expired", []string{idemkey.FormatDate(time.Now().Add(time.Hour))})
	var fsErr *FirstSentError
	if !errors.As(err, &fsErr) {
		t.Errorf("Lookup first sent an hour from now = %v; want a *FirstSentError", err)
	}
}

// TestLookupSealed: a sealed record is opened in Lookup's answer, and one
// that does not open is a store failure, never a reply.
func TestLookupSealed(t *testing.T) {
	st := memory.New()
	e, op, logs := lookupEngine(t, st, WithSealer(newTestRing(t, 1)))
	ctx := asTenant(t.Context(), "tenant-a")
	e.Serve(ctx, op, &stepCall{key: "key-sealed", request: "r", run: func(context.Context) error { return nil }})
	stored, _, ok, err := st.Lookup(ctx, store.ScopeKey("tenant-a", opName, "key-sealed"))
	if err != nil || !ok || bytes.Contains(stored.Outcome, []byte("done")) {
		t.Fatalf("the store holds %q, %v, %v; want it sealed", stored.Outcome, ok, err)
	}
	if ks := mustLookup(t, e, ctx, op, "key-sealed", time.Time{}); ks.State != KeyCompleted || string(ks.Outcome) != "done" {
		t.Errorf("Lookup of a sealed record = %v, %q; want completed, %q", ks.State, ks.Outcome, "done")
	}
	wrong, wrongOp, _ := lookupEngine(t, st, WithSealer(newTestRing(t, 2)))
	ks, err := wrong.Lookup(ctx, wrongOp, "key-sealed", nil)
	if !errors.Is(err, store.ErrUnavailable) || ks.Outcome != nil {
		t.Errorf("Lookup of a record another key sealed = %+v, %v; want store.ErrUnavailable", ks, err)
	}
	if strings.Contains(logs.String(), "key-sealed") {
		t.Errorf("the log holds the raw key:\n%s", logs)
	}
}

// failingLooker is a memory store whose Lookup fails.
type failingLooker struct{ *memory.Store }

func (failingLooker) Lookup(context.Context, store.Key) (store.Entry, []string, bool, error) {
	return store.Entry{}, nil, false, errors.New("connection reset")
}

// TestLookupRefusals: each refusal is its own error, for an entry point to
// answer as it answers a call's.
func TestLookupRefusals(t *testing.T) {
	e, op, _ := lookupEngine(t, memory.New())
	ctx := asTenant(t.Context(), "tenant-a")
	var keyErr *idemkey.KeyError
	if _, err := e.Lookup(ctx, op, "bad key", nil); !errors.As(err, &keyErr) {
		t.Errorf("Lookup of a malformed key = %v; want an *idemkey.KeyError", err)
	}
	if _, err := e.Lookup(t.Context(), op, "key-1", nil); !errors.Is(err, errNoCaller) {
		t.Errorf("Lookup the tenant function refuses = %v; want its error", err)
	}
	plain, plainOp, _ := lookupEngine(t, plainStore{memory.New()})
	if _, err := plain.Lookup(ctx, plainOp, "key-1", nil); !errors.Is(err, errors.ErrUnsupported) || !strings.Contains(err.Error(), "store.Looker") {
		t.Errorf("Lookup on a store without Looker = %v; want errors.ErrUnsupported naming store.Looker", err)
	}
	failing, failingOp, logs := lookupEngine(t, failingLooker{memory.New()})
	if _, err := failing.Lookup(ctx, failingOp, "key-failing", nil); !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("Lookup on a failing store = %v; want store.ErrUnavailable", err)
	}
	if l := logs.String(); !strings.Contains(l, "lookup failed") || strings.Contains(l, "key-failing") {
		t.Errorf("the log of a failed lookup = %s; want an error line without the key", l)
	}
	consumer, err := e.Operation(OperationSpec{Name: "orders", OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Lookup(ctx, consumer, "key-1", nil); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("Lookup on an operation whose calls tell their tenant = %v; want errors.ErrUnsupported", err)
	}
}

// TestLookupMadeFor: a key's state tells whether its record was made for a
// request, as a retry would be told Reused, with the operation bound in
// under ScopeTenant as the call's own fingerprint is.
func TestLookupMadeFor(t *testing.T) {
	for _, scope := range []Scope{ScopeTenantOperation, ScopeTenant} {
		e, op, _ := lookupEngine(t, memory.New(), WithScope(scope))
		ctx := asTenant(t.Context(), "acme")
		c := e.newCall(op)
		if c.start(ctx, request{Tenant: "acme", Key: "key-1", Fingerprint: fingerprint("request-1")}); c.Verdict != Executed {
			t.Fatalf("verdict %v, want executed", c.Verdict)
		}
		if err := c.record(ctx, []byte("reply"), true); err != nil {
			t.Fatal(err)
		}
		ks := mustLookup(t, e, ctx, op, "key-1", time.Time{})
		if !ks.MadeFor(fingerprint("request-1")) || ks.MadeFor(fingerprint("request-2")) {
			t.Errorf("scope %v: MadeFor(the request) = %v, MadeFor(another) = %v; want true, false", scope,
				ks.MadeFor(fingerprint("request-1")), ks.MadeFor(fingerprint("request-2")))
		}
		if unknown := mustLookup(t, e, ctx, op, "key-2", time.Time{}); !unknown.MadeFor(fingerprint("request-2")) {
			t.Errorf("scope %v: MadeFor of a key without a record = false, want true", scope)
		}
	}
}
