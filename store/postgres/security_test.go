package postgres_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
)

// tenantOf reads the caller's tenant from the metadata "tenant", as an
// authentication interceptor would from a verified identity.
func tenantOf(ctx context.Context) (string, error) {
	if v := metadata.ValueFromIncomingContext(ctx, "tenant"); len(v) == 1 {
		return v[0], nil
	}
	return "", status.Error(codes.Unauthenticated, "no tenant")
}

// echo answers each charge with the caller's tenant and the request's
// description, so that a reply shows whose it was.
type echo struct {
	paymentsv1.UnimplementedPaymentServiceServer
	mu   sync.Mutex
	runs map[string]int // by tenant and key
}

func (e *echo) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	tenant, _ := tenantOf(ctx)
	key := metadata.ValueFromIncomingContext(ctx, idemkey.KeyMetadata)[0]
	e.mu.Lock()
	e.runs[tenant+"/"+key]++
	e.mu.Unlock()
	time.Sleep(time.Millisecond) // so that duplicates overlap
	return &paymentsv1.Charge{Id: idemkey.NewKey(), CustomerId: tenant, Description: req.GetDescription()}, nil
}

// Many tenants using the same few keys, concurrently and in random order, on
// two replicas in each mode: every reply is the caller's own, and each
// tenant's key runs once.
func TestTenantsNeverShareReplies(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			rs := newReplicas(t, 2)
			svc := &echo{runs: map[string]int{}}
			var clients []paymentsv1.PaymentServiceClient
			for _, r := range rs {
				opts := []any{engine.WithTenant(tenantOf), engine.WithLogger(nil)}
				if atomic {
					opts = append(opts, interceptor.WithAtomic())
				}
				srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(r.store, opts...)))
				paymentsv1.RegisterPaymentServiceServer(srv, svc)
				clients = append(clients, paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv))))
			}
			const tenants, keys, calls = 20, 5, 400
			var wg sync.WaitGroup
			for w := range 8 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(w), 1))
					for range calls / 8 {
						tenant, key := fmt.Sprint("tenant-", rng.IntN(tenants)), fmt.Sprint("key-", rng.IntN(keys))
						ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", tenant, idemkey.KeyMetadata, key)
						want := tenant + " " + key
						c, err := clients[rng.IntN(len(clients))].CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Description: want})
						switch {
						case status.Code(err) == codes.Aborted: // a duplicate while the first ran
						case err != nil:
							t.Errorf("%s: %v", want, err)
						case c.GetCustomerId() != tenant || c.GetDescription() != want:
							t.Errorf("%s got the reply of %s, %q", want, c.GetCustomerId(), c.GetDescription())
						}
					}
				})
			}
			wg.Wait()
			for k, n := range svc.runs {
				if n != 1 {
					t.Errorf("%s ran %d times", k, n)
				}
			}
		})
	}
}

// Through every path that errs or logs, at the most verbose level, neither the
// raw key, the tenant nor the request reaches a log record, an error message
// or the database.
func TestNothingRawLeaks(t *testing.T) {
	const (
		key    = "raw-key-3f9c2a"
		tenant = "tenant-7d41e0"
		secret = "request-body-b52c77"
	)
	logger, logs := logtest.New()
	r := newReplica(t)
	svc := &blocking{started: make(chan struct{}, 1), proceed: make(chan struct{})}
	serve := func(st *postgres.Store, opts ...any) paymentsv1.PaymentServiceClient {
		srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(st,
			append(opts, engine.WithTenant(tenantOf), engine.WithLogger(logger))...)))
		paymentsv1.RegisterPaymentServiceServer(srv, svc)
		return paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	}
	st := newStore(t, r.pool, postgres.WithLogger(logger))
	twoPhase, atomic := serve(st), serve(st, interceptor.WithAtomic())
	broken := serve(newStore(t, r.pool, postgres.WithLogger(logger), postgres.WithTable("no_such_table"), postgres.WithoutSchemaCheck()))
	var (
		mu   sync.Mutex
		errs []error
	)
	call := func(client paymentsv1.PaymentServiceClient, k, description string) {
		ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", tenant, idemkey.KeyMetadata, k)
		_, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Description: description, CustomerId: secret})
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}

	for _, client := range []paymentsv1.PaymentServiceClient{twoPhase, atomic} {
		k := key + idemkey.NewKey()[:8]
		done := make(chan struct{})
		go func() { call(client, k, "block"); close(done) }()
		<-svc.started
		call(client, k, "block")  // in progress
		call(client, k, secret)   // reused while in progress
		svc.proceed <- struct{}{} //
		<-done
		call(client, k, "block") // replay
		call(client, k, secret)  // reused
	}
	call(twoPhase, key+"-failing", "fail") // a recorded error
	call(broken, key, secret)              // the store fails

	var leaks []string
	for _, raw := range []string{key, tenant, secret} {
		if strings.Contains(logs.String(), raw) {
			leaks = append(leaks, fmt.Sprintf("the logs hold %q", raw))
		}
		for _, err := range errs {
			if err != nil && strings.Contains(err.Error(), raw) {
				leaks = append(leaks, fmt.Sprintf("the error %q holds %q", err, raw))
			}
		}
		var n int
		err := r.pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys
			WHERE position($1::bytea IN key || fingerprint || coalesce(outcome, '')) > 0`, []byte(raw)).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			leaks = append(leaks, fmt.Sprintf("%d rows hold %q", n, raw))
		}
	}
	for _, l := range leaks {
		t.Error(l)
	}
	if !strings.Contains(logs.String(), "level=DEBUG") || !strings.Contains(logs.String(), "42P01") {
		t.Errorf("the store's Debug record of the missing table is not among the logs, so this test proves little:\n%s", logs.String())
	}
	if n := r.count(t, "true"); n < 3 {
		t.Errorf("%d records, want at least 3 to search", n)
	}
}

// blocking is a payment service whose CreateCharge, for the description
// "block", tells started and waits for proceed, and for "fail" answers a
// recorded error. Its reply holds nothing of the request.
type blocking struct {
	paymentsv1.UnimplementedPaymentServiceServer
	started chan struct{}
	proceed chan struct{}
}

func (b *blocking) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	switch req.GetDescription() {
	case "block":
		b.started <- struct{}{}
		<-b.proceed
	case "fail":
		return nil, status.Error(codes.FailedPrecondition, "declined")
	}
	return &paymentsv1.Charge{Id: "ch_1"}, nil
}
