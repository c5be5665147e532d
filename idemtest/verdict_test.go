package idemtest_test

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/tbtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// wantNoSecrets fails t if what the kit reported to r quotes the key or
// the request's customer.
func wantNoSecrets(t *testing.T, r *tbtest.Recorder, secrets ...string) {
	t.Helper()
	report := r.Failures() + r.Logs()
	for _, s := range secrets {
		if strings.Contains(report, s) {
			t.Errorf("the kit's report quotes %q:\n%s", s, report)
		}
	}
}

// A client that sends one key for two operations is caught: the second
// operation's attempts are all refused as reused, which the kit names as
// the client's mistake, with the fix, on gRPC (InvalidArgument) and HTTP
// (422), quoting neither the key nor the request.
func TestKeyReusedForTwoOperations(t *testing.T) {
	chaos := func(b *backend) idemtest.Chaos {
		return idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, Effects: b.effects}
	}
	words := []string{"IDEMPOTENCY_KEY_REUSED", "one key for two operations", "a new key for each operation", "refused by idemkey"}
	t.Run("grpc", func(t *testing.T) {
		b := openBackend(t, "memory")
		r := tbtest.New(t)
		client := grpcClient(t, &service{b: b}, idemtest.New(r, chaos(b)))
		key := idemkey.NewKey()
		for _, customer := range []string{"cus_first", "cus_second"} {
			client.CreateCharge(t.Context(), &paymentsv1.CreateChargeRequest{CustomerId: customer, Amount: 100, Currency: "EUR"}, interceptor.UseKey(key))
		}
		wantNoSecrets(t, r, key, "cus_second")
		tbtest.WantFailure(t, r, words...)
	})
	t.Run("http", func(t *testing.T) {
		b := openBackend(t, "memory")
		r := tbtest.New(t)
		srv := httpServer(t, b, none)
		client := &http.Client{Transport: idemtest.New(r, chaos(b)).RoundTripper(srv.Client().Transport)}
		key := idemkey.NewKey()
		for _, customer := range []string{"cus_first", "cus_second"} {
			postWithKey(t.Context(), client, srv.URL, key, customer)
		}
		wantNoSecrets(t, r, key, "cus_second")
		tbtest.WantFailure(t, r, append(words, "422")...)
	})
}

// idemkey's other refusals name their cause rather than pass as an answer
// that every attempt agrees on: a key first sent longer ago than the
// retention, and a store that cannot be reached (its pool closed).
func TestRefusalsNamed(t *testing.T) {
	t.Run("expired", func(t *testing.T) {
		b := openBackend(t, "memory")
		r := tbtest.New(t)
		client := grpcClient(t, &service{b: b}, idemtest.New(r, idemtest.Chaos{DropReply: true, Effects: b.effects}))
		key := idemkey.NewKey()
		_, err := client.CreateCharge(t.Context(), &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"},
			interceptor.UseKeyFirstSent(key, time.Now().Add(-72*time.Hour)))
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("charge: %v, want FailedPrecondition", err)
		}
		wantNoSecrets(t, r, key)
		tbtest.WantFailure(t, r, "IDEMPOTENCY_KEY_EXPIRED", "longer ago than the server keeps keys", "retention")
	})
	t.Run("store unavailable", func(t *testing.T) {
		b := openBackend(t, "postgres")
		pool := pgtest.Pool(t, pgtest.Schema(t))
		if err := postgres.Migrate(t.Context(), pool); err != nil {
			t.Fatal(err)
		}
		b.store = grpctest.Must(postgres.New(pool))
		pool.Close()
		r := tbtest.New(t)
		client := grpcClient(t, &service{b: b}, idemtest.New(r, idemtest.Chaos{Duplicates: 1, Effects: b.effects}))
		_, err := client.CreateCharge(t.Context(), &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"})
		if status.Code(err) != codes.Unavailable {
			t.Errorf("charge: %v, want Unavailable", err)
		}
		tbtest.WantFailure(t, r, "IDEMPOTENCY_STORE_UNAVAILABLE", "checked nothing of the handler", "reachable")
	})
}

// retryUnavailable is a service config that retries CreateCharge on
// UNAVAILABLE below the interceptors, where the kit does not see it.
const retryUnavailable = `{"methodConfig": [{
	"name": [{"service": "example.payments.v1.PaymentService"}],
	"retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
		"backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
}]}`

// A handler that makes its effect and then answers an error that idemkey
// releases (Unavailable, 503) is caught as that, with its fix, never as a
// handler cut short: over gRPC, whose retry policy runs it again unseen by
// the kit; with the kit's server half, which saw the run's Unavailable; and
// over HTTP, where the kit saw the 503 and the retry that ran past it.
func TestEffectBeforeReleasedError(t *testing.T) {
	wrong := "not in a context the caller can cancel"
	for _, half := range []bool{false, true} {
		t.Run(map[bool]string{false: "grpc", true: "grpc with the server half"}[half], func(t *testing.T) {
			b := openBackend(t, "postgres")
			r := tbtest.New(t)
			kit := idemtest.New(r, idemtest.Chaos{Effects: b.effects})
			client := grpcClientWith(t, &service{b: b, mistake: effectThenReleased}, kit, half, grpc.WithDefaultServiceConfig(retryUnavailable))
			if err := createCharge(t.Context(), client, "cus_1", false); err != nil {
				t.Errorf("charge: %v", err)
			}
			if strings.Contains(r.Failures(), wrong) {
				t.Errorf("the kit blames cancellation:\n%s", r.Failures())
			}
			words := []string{"one key, 2 effects", "an error that idemkey releases rather than records", "undo the effect before failing"}
			if half {
				words = append(words, "The handler answered Unavailable for this key after making its effect")
			}
			tbtest.WantFailure(t, r, words...)
		})
	}
	t.Run("http", func(t *testing.T) {
		b := openBackend(t, "postgres")
		r := tbtest.New(t)
		srv := httpServer(t, b, effectThenReleased)
		client := &http.Client{Transport: idemtest.New(r, idemtest.Chaos{DropReply: true, Effects: b.effects}).RoundTripper(srv.Client().Transport)}
		if code, err := postCharge(t.Context(), client, srv.URL, "cus_1", false); code != http.StatusCreated {
			t.Errorf("charge: %d, %v; want 201", code, err)
		}
		if strings.Contains(r.Failures(), wrong) {
			t.Errorf("the kit blames cancellation:\n%s", r.Failures())
		}
		tbtest.WantFailure(t, r, "one key, 2 effects", "Attempt 1 answered 503, an error that idemkey releases rather than records", "undo the effect before failing")
	})
}

// A handler that answers first and makes its effect afterwards, in a
// goroutine, is caught as that, not as an effect counter that counts
// nothing. The goroutine makes its effect once the kit has counted the
// call's effects after its answer.
func TestEffectAfterReply(t *testing.T) {
	b := openBackend(t, "postgres")
	var reads atomic.Int32
	effects := func(ctx context.Context) (int, error) {
		n, err := b.effects(ctx)
		// Only once the count after the call's answer is read does the
		// handler's goroutine make its effect: the kit reads it later.
		if reads.Add(1) == 2 {
			close(b.afterReply)
		}
		return n, err
	}
	r := tbtest.New(t)
	client := grpcClient(t, &service{b: b, mistake: effectAfterReply}, idemtest.New(r, idemtest.Chaos{Effects: effects}))
	if err := createCharge(t.Context(), client, "cus_1", false); err != nil {
		t.Errorf("charge: %v", err)
	}
	tbtest.WantFailure(t, r, "the handler makes its effect after its reply", "in a goroutine", "Make the effect before the handler returns")
	b.late.Wait()
}

// A test that calls only CheckAtomic, on a correct handler, passes: the
// check counts as the kit's check.
func TestCheckAtomicAlone(t *testing.T) {
	b := openBackend(t, "postgres-atomic")
	r := tbtest.New(t)
	idemtest.New(r, idemtest.Chaos{Effects: b.effects}).CheckAtomic(b.store, func(ctx context.Context) error {
		_, err := b.charge(ctx, "cus_1", none, nil)
		return err
	})
	tbtest.WantPass(t, r)
}

// With the kit's server half, Chaos.Cancel cancels every first attempt in
// its call (held once its handler returned): correct handlers pass on
// every store, and in atomic mode a handler that writes through the pool
// is caught every time, since the held attempt's transaction rolls back
// and the retry writes again.
func TestServerHalfCancel(t *testing.T) {
	for _, kind := range backendKinds {
		for _, m := range []mistake{none, poolWrite} {
			t.Run(kind+map[mistake]string{none: "", poolWrite: "/pool write"}[m], func(t *testing.T) {
				b := openBackend(t, kind)
				for range 3 {
					r := tbtest.New(t)
					kit := idemtest.New(r, idemtest.Chaos{DropReply: true, Duplicates: 3, Cancel: true, Effects: b.effects})
					client := grpcClientWith(t, &service{b: b, mistake: m}, kit, true)
					if err := createCharge(t.Context(), client, "cus_1", false); err != nil {
						t.Errorf("charge: %v", err)
					}
					if err := createCharge(t.Context(), client, declined, false); status.Code(err) != codes.FailedPrecondition {
						t.Errorf("declined charge: %v, want FailedPrecondition", err)
					}
					if report := r.Logs() + r.Failures(); strings.Count(report, "attempt 1 (cancelled") != 2 || strings.Contains(report, "before it could be cancelled") {
						t.Errorf("the kit did not cancel both first attempts while the server held them:\n%s", report)
					}
					if m == poolWrite && b.atomic {
						tbtest.WantFailure(t, r, "one key, 2 effects", "transaction rolled back", "postgres.TxFromContext(ctx)", "not through the pool")
						continue
					}
					tbtest.WantPass(t, r)
				}
			})
		}
	}
}
