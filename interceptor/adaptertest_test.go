package interceptor_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/adaptertest"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// TestAdapterCases runs the behaviour cases every entry point passes over a
// real grpc-go client and server.
func TestAdapterCases(t *testing.T) {
	adaptertest.Run(t, adaptertest.Adapter{
		Name:  "grpc",
		Serve: serveConformance,
		Status: map[string]int{
			idemkey.ReasonKeyMissing:       int(codes.InvalidArgument),
			idemkey.ReasonKeyInvalid:       int(codes.InvalidArgument),
			idemkey.ReasonKeyReused:        int(codes.InvalidArgument),
			idemkey.ReasonInProgress:       int(codes.Aborted),
			idemkey.ReasonStoreUnavailable: int(codes.Unavailable),
			idemkey.ReasonStoreFull:        int(codes.ResourceExhausted),
			idemkey.ReasonKeyExpired:       int(codes.FailedPrecondition),
			idemkey.ReasonFirstSentInvalid: int(codes.InvalidArgument),
			idemkey.ReasonOutcomeUnknown:   int(codes.Unknown),
			"internal":                     int(codes.Internal),
		},
	}, adaptertest.Stores()...)
}

// conformanceService is the suite's Service behind the PaymentService's
// CreateCharge: the description names the behaviour.
type conformanceService struct {
	paymentsv1.UnimplementedPaymentServiceServer
	svc *adaptertest.Service
}

func (s conformanceService) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	tenant, _ := bearerTenant(ctx)
	id, res := s.svc.Handle(ctx, tenant, req.GetAmount(), req.GetDescription())
	switch res {
	case adaptertest.Recorded:
		return nil, status.Error(codes.FailedPrecondition, "declined "+id)
	case adaptertest.Released:
		return nil, status.Error(codes.Unavailable, "try later "+id)
	}
	return &paymentsv1.Charge{Id: id, Amount: req.GetAmount()}, nil
}

// GetCharge, which the interceptor does not cover, runs the Service too: the
// id names the behaviour.
func (s conformanceService) GetCharge(ctx context.Context, req *paymentsv1.GetChargeRequest) (*paymentsv1.Charge, error) {
	tenant, _ := bearerTenant(ctx)
	id, res := s.svc.Handle(ctx, tenant, 0, req.GetId())
	if res != adaptertest.OK {
		return nil, status.Error(codes.FailedPrecondition, "declined "+id)
	}
	return &paymentsv1.Charge{Id: id}, nil
}

// bearerTenant is the tenant of "authorization: Bearer TENANT".
func bearerTenant(ctx context.Context) (string, error) {
	v := metadata.ValueFromIncomingContext(ctx, "authorization")
	if len(v) != 1 || !strings.HasPrefix(v[0], "Bearer ") {
		return "", status.Error(codes.Unauthenticated, "no tenant")
	}
	return strings.TrimPrefix(v[0], "Bearer "), nil
}

// redactConformance is the suite's redaction (adaptertest.Redact) in gRPC's
// terms: the charge's id, or the error's message.
func redactConformance(_ context.Context, _ string, reply *interceptor.Reply) {
	if c, ok := reply.Response.(*paymentsv1.Charge); ok {
		c.Id = adaptertest.Redact(c.Id)
	}
	if reply.Err != nil {
		st := status.Convert(reply.Err)
		reply.Err = status.Error(st.Code(), adaptertest.Redact(st.Message()))
	}
}

func serveConformance(t *testing.T, cfg adaptertest.Config) func(context.Context, adaptertest.Request) adaptertest.Reply {
	var opts []interceptor.Option
	if cfg.Atomic {
		opts = append(opts, interceptor.WithAtomic())
	}
	if cfg.Redact {
		opts = append(opts, interceptor.WithRedaction(redactConformance))
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(cfg.Engine(t, bearerTenant), opts...))))
	paymentsv1.RegisterPaymentServiceServer(srv, conformanceService{svc: cfg.Service})
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	return func(ctx context.Context, r adaptertest.Request) adaptertest.Reply {
		md := metadata.Pairs("authorization", "Bearer "+r.Tenant)
		if r.Key != "" {
			md.Append(idemkey.KeyMetadata, r.Key)
			if r.KeyTwice {
				md.Append(idemkey.KeyMetadata, r.Key)
			}
		}
		if r.FirstSent != "" {
			md.Append(idemkey.FirstSentMetadata, r.FirstSent)
		}
		if r.FirstRegion != "" {
			md.Append(idemkey.FirstRegionMetadata, r.FirstRegion)
		}
		var header, trailer metadata.MD
		ctx, opts := metadata.NewOutgoingContext(ctx, md), []grpc.CallOption{grpc.Header(&header), grpc.Trailer(&trailer)}
		var charge *paymentsv1.Charge
		var err error
		if r.Uncovered {
			charge, err = client.GetCharge(ctx, &paymentsv1.GetChargeRequest{Id: r.Behaviour}, opts...)
		} else {
			charge, err = client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: r.Amount, Description: r.Behaviour}, opts...)
		}
		replayed := trailer.Get(idemkey.ReplayedMetadata)
		reply := adaptertest.Reply{OK: err == nil, Replayed: idemkey.ParseReplayed(replayed), Executed: idemkey.ParseExecuted(replayed),
			Ignored: idemkey.ParseIgnored(trailer.Get(idemkey.StatusMetadata)), Reason: idemkey.Reason(err),
			Expires: strings.Join(append(header.Get(idemkey.ExpiresMetadata), trailer.Get(idemkey.ExpiresMetadata)...), ", ")}
		if err != nil {
			st := status.Convert(err)
			reply.Status, reply.Body = int(st.Code()), st.Message()
			reply.RetryAfter, _ = idemkey.RetryDelay(err)
			return reply
		}
		reply.Body = charge.GetId()
		return reply
	}
}
