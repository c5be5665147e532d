package interceptor_test

import (
	"context"
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
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// callerCredentials are per-call credentials of the caller's own: the tenant
// the server interceptor reads, and a token for the handler.
type callerCredentials struct{}

func (callerCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"tenant": "acme", "authorization": "Bearer t-1"}, nil
}

func (callerCredentials) RequireTransportSecurity() bool { return false }

// seenService is a PaymentService whose handlers pass on the metadata of
// every attempt that reaches them.
type seenService struct {
	*service
	seen chan metadata.MD
}

func (s seenService) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	s.seen <- md
	return s.service.CreateCharge(ctx, req)
}

func (s seenService) GetCharge(ctx context.Context, req *paymentsv1.GetChargeRequest) (*paymentsv1.Charge, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	s.seen <- md
	return s.service.GetCharge(ctx, req)
}

// newSeenE2E is a real server, with the server interceptor, in front of a
// seenService; its clients are those of e2e.
func newSeenE2E(t *testing.T) (seenService, paymentsv1.PaymentServiceClient, paymentsv1.PaymentServiceClient) {
	svc := seenService{service: newService(), seen: make(chan metadata.MD, 100)}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(memory.New(), engine.WithTenant(tenantFromMetadata))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := grpctest.Serve(t, srv)
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis,
		grpc.WithDefaultServiceConfig(retryServiceConfig),
		grpc.WithUnaryInterceptor(grpctest.Must(interceptor.UnaryClientInterceptor()))))
	plain := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis, grpc.WithDisableRetry()))
	return svc, client, plain
}

func drainMD(ch chan metadata.MD) []metadata.MD {
	var mds []metadata.MD
	for {
		select {
		case md := <-ch:
			mds = append(mds, md)
		default:
			return mds
		}
	}
}

// UseKey and per-call credentials of the caller's own both reach the
// server, whichever comes first, on every attempt of gRPC's retry policy:
// the handler sees the credentials' token, and the server interceptor the
// key, which it honours by replaying the call made again with it.
func TestUseKeyBesideCallerCredentials(t *testing.T) {
	at := time.Now().Add(-time.Hour).Truncate(time.Second)
	for name, tc := range map[string]struct {
		opts      []grpc.CallOption
		firstSent time.Time // zero: now
	}{
		"credentials, then UseKey": {opts: []grpc.CallOption{grpc.PerRPCCredentials(callerCredentials{}), interceptor.UseKey("order-1")}},
		"UseKey, then credentials": {opts: []grpc.CallOption{interceptor.UseKey("order-1"), grpc.PerRPCCredentials(callerCredentials{})}},
		"credentials, then UseKeyFirstSent": {
			opts:      []grpc.CallOption{grpc.PerRPCCredentials(callerCredentials{}), interceptor.UseKeyFirstSent("order-1", at)},
			firstSent: at,
		},
	} {
		t.Run(name, func(t *testing.T) {
			svc, client, _ := newSeenE2E(t)
			svc.create = func(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
				if svc.runs.Load() == 1 {
					return nil, status.Error(codes.Unavailable, "try again")
				}
				return chargeFor(req, 1), nil
			}
			first, err := client.CreateCharge(context.Background(), request(1), tc.opts...)
			if err != nil {
				t.Fatalf("call with UseKey and credentials of its own: %v", err)
			}
			var trailer metadata.MD
			again, err := client.CreateCharge(context.Background(), request(1), append(tc.opts, grpc.Trailer(&trailer))...)
			if err != nil || again.GetId() != first.GetId() || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Errorf("the call made again with its key: %v, %v (replayed %v); want the first reply %v, replayed",
					again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), first)
			}
			wantRuns(t, svc.service, 2) // Unavailable, then the reply

			attempts := drainMD(svc.seen)
			if len(attempts) != 2 {
				t.Fatalf("the handler saw %d attempts, want 2", len(attempts))
			}
			sent := attempts[0].Get(idemkey.FirstSentMetadata)
			for i, md := range attempts {
				if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer t-1" {
					t.Errorf("attempt %d: the handler saw authorization %q, want the credentials' [Bearer t-1]", i+1, got)
				}
				if got := md.Get(idemkey.KeyMetadata); len(got) != 1 || got[0] != "order-1" {
					t.Errorf("attempt %d: the handler saw keys %q, want [order-1]", i+1, got)
				}
				if got := md.Get(idemkey.FirstSentMetadata); len(got) != 1 || len(sent) != 1 || got[0] != sent[0] {
					t.Errorf("attempt %d: first-sent %q, want one, the first attempt's %q", i+1, got, sent)
				}
			}
			if !tc.firstSent.IsZero() && (len(sent) != 1 || sent[0] != idemkey.FormatDate(tc.firstSent)) {
				t.Errorf("first-sent %q, want UseKeyFirstSent's %s", sent, idemkey.FormatDate(tc.firstSent))
			}
		})
	}
}

// UseKey is the client interceptor's: it sends no key to a method the
// interceptor does not cover, nor on a connection without the interceptor,
// and in neither case displaces the caller's own credentials.
func TestUseKeyWithoutKeyedCall(t *testing.T) {
	svc, client, plain := newSeenE2E(t)
	opts := []grpc.CallOption{grpc.PerRPCCredentials(callerCredentials{}), interceptor.UseKey("order-1")}
	for name, call := range map[string]func() error{
		"an uncovered method": func() error {
			_, err := client.GetCharge(context.Background(), &paymentsv1.GetChargeRequest{Id: "ch_1"}, opts...)
			return err
		},
		"no client interceptor": func() error {
			_, err := plain.CreateCharge(context.Background(), request(1), opts...)
			return err
		},
	} {
		if err := call(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		attempts := drainMD(svc.seen)
		if len(attempts) != 1 {
			t.Fatalf("%s: the handler saw %d attempts, want 1", name, len(attempts))
		}
		if got := attempts[0].Get("authorization"); len(got) != 1 || got[0] != "Bearer t-1" {
			t.Errorf("%s: the handler saw authorization %q, want the credentials' [Bearer t-1]", name, got)
		}
		if got := attempts[0].Get(idemkey.KeyMetadata); len(got) != 0 {
			t.Errorf("%s: the handler saw keys %q, want none", name, got)
		}
	}
}
