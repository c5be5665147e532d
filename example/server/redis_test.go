package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/redistest"
)

// Server processes sharing their keys in Redis, one server or a cluster,
// behave as on PostgreSQL in two-phase mode: a duplicate sent to process B
// while A runs the first call (it has charged the processor) is Aborted (in
// progress), the retry on B gets
// A's reply, the key reused for another request is refused, and the reply
// survives both processes being killed. The charges are in PostgreSQL, so
// that they are counted across processes.
func TestKeysInRedisBehaveAsPostgres(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store func(t *testing.T) []string // the server's flags for its keys
	}{
		{"postgres", func(*testing.T) []string { return nil }},
		{"redis-url", func(t *testing.T) []string { return []string{"-redis-url", "redis://" + redistest.Start(t).Addr} }},
		{"redis-cluster", func(t *testing.T) []string {
			return []string{"-redis-cluster", strings.Join(redistest.StartCluster(t, 5*time.Second).Addrs(), ",")}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			bin := servertest.Build(t)
			schema := pgtest.Schema(t)
			p := startProcessor(t)
			args := append([]string{"-database-url", pgtest.SchemaURL(schema), "-atomic=false", "-processor-url", p.url}, tc.store(t)...)
			a := servertest.Start(t, bin, append(args, "-handler-delay=2s")...)
			b := servertest.Start(t, bin, args...)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

			first := make(chan *paymentsv1.Charge, 1)
			go func() {
				charge, _, err := create(a, key, req)
				if err != nil {
					t.Errorf("first call on A: %v", err)
				}
				first <- charge
			}()
			pool := pgtest.Pool(t, schema)
			waitUntil(t, "A has charged the processor", func() bool { return p.charges(t) == 1 })
			ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key), 500*time.Millisecond)
			defer cancel()
			if _, err := paymentsv1.NewPaymentServiceClient(b.Conn).CreateCharge(ctx, req); status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
				t.Fatalf("duplicate on B during A's call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
			}
			want := <-first
			wantReplay(t, b, key, req, want, "B")
			other := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 999, Currency: "EUR"}
			if _, _, err := create(b, key, other); status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
				t.Errorf("the key reused for another request: %v, want InvalidArgument %s", err, idemkey.ReasonKeyReused)
			}
			for _, s := range []*servertest.Server{a, b} {
				if err := s.Kill(); err != nil {
					t.Fatal(err)
				}
			}
			wantReplay(t, servertest.Start(t, bin, args...), key, req, want, "a new process after both were killed")
			if n := count(t, pool, "charges"); n != 1 {
				t.Errorf("%d charges in the database, want 1", n)
			}
			if n := p.charges(t); n != 1 {
				t.Errorf("%d charges at the processor, want 1", n)
			}
		})
	}
}

// A Redis server that may evict keys stops the server at start, with a
// message that says why.
func TestRedisEvictionRefused(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory-policy", "allkeys-lru")
	s, err := servertest.Launch(servertest.Build(t), "-redis-url", "redis://"+srv.Addr, "-database-url=")
	if err == nil {
		s.Kill()
		t.Fatal("the server started on a Redis whose maxmemory-policy is allkeys-lru")
	}
	if !strings.Contains(err.Error(), "noeviction") {
		t.Errorf("the server's failure does not name the policy it needs: %v", err)
	}
}
