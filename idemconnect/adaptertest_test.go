package idemconnect_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/internal/adaptertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

var conformanceStatus = map[string]int{
	idemkey.ReasonKeyMissing:       int(connect.CodeInvalidArgument),
	idemkey.ReasonKeyInvalid:       int(connect.CodeInvalidArgument),
	idemkey.ReasonKeyReused:        int(connect.CodeInvalidArgument),
	idemkey.ReasonInProgress:       int(connect.CodeAborted),
	idemkey.ReasonStoreUnavailable: int(connect.CodeUnavailable),
	idemkey.ReasonStoreFull:        int(connect.CodeResourceExhausted),
	idemkey.ReasonKeyExpired:       int(connect.CodeFailedPrecondition),
	idemkey.ReasonFirstSentInvalid: int(connect.CodeInvalidArgument),
	idemkey.ReasonOutcomeUnknown:   int(connect.CodeUnknown),
	"internal":                     int(connect.CodeInternal),
}

// TestAdapterCases runs the behaviour cases every entry point passes over a
// real connect-go client and server: with the Connect protocol on every
// store, and with the gRPC and gRPC-Web protocols, whose answers travel
// differently (trailers), on the memory store.
func TestAdapterCases(t *testing.T) {
	stores := adaptertest.Stores()
	for _, p := range []struct {
		name   string
		stores []adaptertest.Store
		opts   []connect.ClientOption
	}{
		{"connect", stores, nil},
		{"connect-grpc", stores[:1], []connect.ClientOption{connect.WithGRPC()}},
		{"connect-grpcweb", stores[:1], []connect.ClientOption{connect.WithGRPCWeb()}},
	} {
		t.Run(p.name, func(t *testing.T) {
			adaptertest.Run(t, adaptertest.Adapter{
				Name: p.name,
				Serve: func(t *testing.T, cfg adaptertest.Config) func(context.Context, adaptertest.Request) adaptertest.Reply {
					return serveConformance(t, cfg, p.opts...)
				},
				Status: conformanceStatus,
			}, p.stores...)
		})
	}
}

// conformanceHandler is the suite's Service behind CreateCharge: the
// description names the behaviour.
func conformanceHandler(svc *adaptertest.Service) chargeHandler {
	return func(ctx context.Context, req *chargeRequest) (*chargeResponse, error) {
		tenant, _ := bearerTenant(ctx)
		id, res := svc.Handle(ctx, tenant, req.Msg.GetAmount(), req.Msg.GetDescription())
		switch res {
		case adaptertest.Recorded:
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("declined "+id))
		case adaptertest.Released:
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("try later "+id))
		}
		return connect.NewResponse(&paymentsv1.Charge{Id: id, Amount: req.Msg.GetAmount()}), nil
	}
}

// redactConformance is the suite's redaction (adaptertest.Redact) in
// Connect's terms: the charge's id, or the error's message.
func redactConformance(_ context.Context, _ string, reply *idemconnect.Reply) {
	if c, ok := reply.Response.(*paymentsv1.Charge); ok {
		c.Id = adaptertest.Redact(c.Id)
	}
	if ce := (*connect.Error)(nil); errors.As(reply.Err, &ce) {
		reply.Err = connect.NewError(ce.Code(), errors.New(adaptertest.Redact(ce.Message())))
	}
}

func serveConformance(t *testing.T, cfg adaptertest.Config, clientOpts ...connect.ClientOption) func(context.Context, adaptertest.Request) adaptertest.Reply {
	var opts []idemconnect.Option
	if cfg.Atomic {
		opts = append(opts, idemconnect.WithAtomic())
	}
	if cfg.Redact {
		opts = append(opts, idemconnect.WithRedaction(redactConformance))
	}
	// GetCharge, which the interceptor does not cover, runs the Service
	// too: the id names the behaviour.
	get := func(ctx context.Context, req *getRequest) (*chargeResponse, error) {
		tenant, _ := bearerTenant(ctx)
		id, res := cfg.Service.Handle(ctx, tenant, 0, req.Msg.GetId())
		if res != adaptertest.OK {
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("declined "+id))
		}
		return connect.NewResponse(&paymentsv1.Charge{Id: id}), nil
	}
	url := serveGet(t, conformanceHandler(cfg.Service), get, newInterceptor(t, cfg.Engine(t, bearerTenant), opts...))
	client := newChargeClient(t, url, clientOpts...)
	getClient := connect.NewClient[paymentsv1.GetChargeRequest, paymentsv1.Charge](h2c(t), url+getCharge, clientOpts...)
	return func(ctx context.Context, r adaptertest.Request) adaptertest.Reply {
		req := connect.NewRequest(&paymentsv1.CreateChargeRequest{Amount: r.Amount, Description: r.Behaviour})
		if r.Uncovered {
			req := connect.NewRequest(&paymentsv1.GetChargeRequest{Id: r.Behaviour})
			setHeaders(req.Header(), r)
			resp, err := getClient.CallUnary(ctx, req)
			return connectReply(resp, err)
		}
		setHeaders(req.Header(), r)
		resp, err := client.CallUnary(ctx, req)
		return connectReply(resp, err)
	}
}

// setHeaders sets the suite's request's headers.
func setHeaders(h http.Header, r adaptertest.Request) {
	h.Set("Authorization", "Bearer "+r.Tenant)
	if r.Key != "" {
		h.Add(idemkey.KeyHeader, r.Key)
		if r.KeyTwice {
			h.Add(idemkey.KeyHeader, r.Key)
		}
	}
	if r.FirstSent != "" {
		h.Set(idemkey.FirstSentHeader, r.FirstSent)
	}
	if r.FirstRegion != "" {
		h.Set(idemkey.FirstRegionHeader, r.FirstRegion)
	}
}

// connectReply translates a call's result into the suite's terms: the marks
// are read from the header of a reply, from the metadata of an error.
func connectReply(resp *connect.Response[paymentsv1.Charge], err error) adaptertest.Reply {
	if err != nil {
		reply := adaptertest.Reply{Status: int(connect.CodeOf(err)), Reason: idemkey.Reason(err)}
		var ce *connect.Error
		if errors.As(err, &ce) {
			reply.Body = ce.Message()
			markFate(&reply, ce.Meta())
			reply.Expires = strings.Join(ce.Meta().Values(idemkey.ExpiresHeader), ",")
		}
		reply.RetryAfter, _ = idemkey.RetryDelay(err)
		return reply
	}
	reply := adaptertest.Reply{OK: true, Body: resp.Msg.GetId(), Expires: strings.Join(resp.Header().Values(idemkey.ExpiresHeader), ",")}
	markFate(&reply, resp.Header())
	return reply
}

func markFate(r *adaptertest.Reply, h http.Header) {
	replayed := h.Values(idemkey.ReplayedHeader)
	r.Replayed, r.Executed = idemkey.ParseReplayed(replayed), idemkey.ParseExecuted(replayed)
	r.Ignored = idemkey.ParseIgnored(h.Values(idemkey.StatusHeader))
}
