package main

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// Deadlines at the edges, on the built server and every store and mode: a
// call with no deadline, with 1ns, and with the largest gRPC sends
// (grpc-timeout 2562047H). Whatever the first attempt got, a retry without
// a deadline gets one charge's reply, which every later retry replays; a
// duplicate sent while a call with the largest deadline runs is answered
// "in progress", never run beside it.
func TestDeadlinesAtTheEdges(t *testing.T) {
	for _, mode := range []struct {
		name   string
		db     bool
		atomic bool
	}{{"postgres/atomic", true, true}, {"postgres/2-phase", true, false}, {"memory", false, false}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			args := []string{"-database-url=", "-handler-delay=300ms"}
			if mode.db {
				args = []string{"-database-url=" + pgtest.SchemaURL(pgtest.Schema(t)), "-handler-delay=300ms", "-atomic=" + strconv.FormatBool(mode.atomic)}
			}
			s := servertest.Start(t, servertest.Build(t), args...)
			client := paymentsv1.NewPaymentServiceClient(s.Conn)
			call := func(key string, timeout time.Duration, amount int64) (*paymentsv1.Charge, metadata.MD, error) {
				ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
				if timeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, timeout)
					defer cancel()
				}
				var trailer metadata.MD
				c, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_deadline", Amount: amount, Currency: "EUR"}, grpc.Trailer(&trailer))
				return c, trailer, err
			}
			for i, timeout := range []time.Duration{0, time.Nanosecond, math.MaxInt64} {
				key := idemkey.NewKey()
				_, _, err := call(key, timeout, int64(i+1))
				if timeout == time.Nanosecond && status.Code(err) != codes.DeadlineExceeded {
					t.Errorf("1ns: %v, want DeadlineExceeded", err)
				}
				if timeout != time.Nanosecond && err != nil {
					t.Errorf("deadline %v: %v", timeout, err)
				}
				first, _, err := call(key, 0, int64(i+1))
				if err != nil {
					t.Fatalf("deadline %v, retry: %v", timeout, err)
				}
				again, trailer, err := call(key, 0, int64(i+1))
				if err != nil || again.GetId() != first.GetId() || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
					t.Errorf("deadline %v, second retry: %v, %v (replayed %v); want %s replayed", timeout, again.GetId(), err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), first.GetId())
				}
			}
			// A duplicate of a call with the largest deadline, while it runs.
			key := idemkey.NewKey()
			done := make(chan error, 1)
			go func() { _, _, err := call(key, math.MaxInt64, 99); done <- err }()
			time.Sleep(100 * time.Millisecond)
			if _, _, err := call(key, 50*time.Millisecond, 99); status.Code(err) != codes.Aborted && status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("duplicate of a call with the largest deadline: %v, want Aborted (or its own deadline)", err)
			}
			if err := <-done; err != nil {
				t.Errorf("the call with the largest deadline: %v", err)
			}
			if _, trailer, err := call(key, 0, 99); err != nil || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Errorf("retry after the call with the largest deadline: %v (replayed %v)", err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
		})
	}
}
