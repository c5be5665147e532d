package example_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
)

// readCounter is a store that counts the calls that read or reserve a key,
// and passes every call on to the store it wraps, Finder and Atomic included.
type readCounter struct {
	store.Store
	n atomic.Int32
}

func (c *readCounter) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	c.n.Add(1)
	return c.Store.Reserve(ctx, r)
}

func (c *readCounter) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	c.n.Add(1)
	return c.Store.(store.Finder).Find(ctx, key)
}

func (c *readCounter) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	c.n.Add(1)
	return c.Store.(store.Atomic).Begin(ctx, r)
}

// A duplicate sent while a first call runs its 10-second handler ends with
// the first call's reply, under the shipped service config (5 attempts, a
// 10 s timeout), in both modes and on both stores, with a bounded number of
// reads of the store.
func TestDuplicateOfALongCallConverges(t *testing.T) {
	if testing.Short() {
		t.Skip("a handler of 10 seconds")
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			be := b.open(t)
			st := &readCounter{Store: be.store}
			srv, _, _ := example.NewServer(grpctest.Must(example.NewEngine(st)), example.Config{Ledger: be.ledger, Atomic: be.atomic, HandlerDelay: 10 * time.Second})
			lis := grpctest.Serve(t, srv)
			plain := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis, grpc.WithDisableRetry()))
			shipped := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis,
				grpc.WithDefaultServiceConfig(example.ServiceConfig), grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

			first := make(chan *paymentsv1.Charge, 1)
			go func() {
				c, err := plain.CreateCharge(withKey("acme", key), req)
				if err != nil {
					t.Errorf("first call: %v", err)
				}
				first <- c
			}()
			time.Sleep(500 * time.Millisecond)
			st.n.Store(0)
			var trailer metadata.MD
			dup, err := shipped.CreateCharge(as("acme"), req, interceptor.UseKey(key), grpc.Trailer(&trailer))
			reads := st.n.Load()
			if err != nil {
				t.Fatalf("duplicate: %v, want the first call's reply", err)
			}
			if want := <-first; !proto.Equal(dup, want) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Errorf("duplicate: %v (replayed %v), want the first call's %v, replayed", dup, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), want)
			}
			// Per attempt: a read before reserving, the reservation, and at
			// most 5 + 2s/500ms polls while the server holds the duplicate.
			t.Logf("the duplicate read the store %d times", reads)
			if reads > 5*(2+9) {
				t.Errorf("the duplicate read the store %d times, more than 5 attempts of 11", reads)
			}
		})
	}
}
