package idemconnect_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/internal/logtest"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemconnect"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/sealtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// A sealed record made over gRPC replays over Connect, and the reverse,
// with the same key ring: the record format is shared, sealed or not.
func TestSealedCrossTransport(t *testing.T) {
	st := memory.New()
	ring := sealtest.Ring(t, 1)
	runs := &counter{}
	eng := newEngine(t, st, engine.WithTenant(acme), engine.WithSealer(ring)) // one engine for both entry points
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, grpcCharges{c: runs})
	grpcClient := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	connectClient := newChargeClient(t, serve(t, runs.handle, newInterceptor(t, eng)))
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR", Description: "secret tea"}

	first, err := grpcClient.CreateCharge(metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, "k1"), req)
	if err != nil {
		t.Fatal(err)
	}
	res, _, _ := st.Find(t.Context(), store.ScopeKey("acme", createCharge, "k1"))
	if bytes.Contains(res.Outcome, []byte("secret tea")) {
		t.Fatalf("the record holds the reply in the clear")
	}
	replay, err := call(t.Context(), connectClient, "k1", req)
	if err != nil || !proto.Equal(first, replay.Msg) || !idemkey.ParseReplayed(replay.Header().Values(idemkey.ReplayedHeader)) {
		t.Fatalf("Connect replay %v, %v; want the gRPC reply %v", replay, err, first)
	}
	again, err := call(t.Context(), connectClient, "k2", req)
	if err != nil {
		t.Fatal(err)
	}
	var trailer metadata.MD
	grpcReplay, err := grpcClient.CreateCharge(metadata.AppendToOutgoingContext(t.Context(), idemkey.KeyMetadata, "k2"), req, grpc.Trailer(&trailer))
	if err != nil || !proto.Equal(again.Msg, grpcReplay) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("gRPC replay %v, %v; want the Connect reply %v", grpcReplay, err, again.Msg)
	}
	runs.wantRuns(t, 2)
}

func TestRedaction(t *testing.T) {
	redact := func(_ context.Context, procedure string, r *idemconnect.Reply) {
		if procedure != createCharge {
			panic("procedure " + procedure)
		}
		r.Response.(*paymentsv1.Charge).Description = ""
		r.Header.Del("X-Charge-Token")
	}
	url := serve(t, func(_ context.Context, req *chargeRequest) (*chargeResponse, error) {
		resp := connect.NewResponse(&paymentsv1.Charge{Id: "ch_1", Description: req.Msg.GetDescription()})
		resp.Header().Set("X-Charge-Token", "tok_secret")
		resp.Header().Set("X-Region", "eu")
		return resp, nil
	}, newInterceptor(t, single(t), idemconnect.WithRedaction(redact), idemconnect.WithReplayedHeaders("X-Charge-Token", "X-Region")))
	client := newChargeClient(t, url)
	req := &paymentsv1.CreateChargeRequest{Amount: 100, Description: "card 4242"}
	first, err := call(t.Context(), client, "k1", req)
	if err != nil || first.Msg.GetDescription() != "card 4242" || first.Header().Get("X-Charge-Token") != "tok_secret" {
		t.Fatalf("first call %v, %v; want the whole reply", first, err)
	}
	replay, err := call(t.Context(), client, "k1", req)
	if err != nil || replay.Msg.GetDescription() != "" || replay.Msg.GetId() != "ch_1" {
		t.Fatalf("replay %v, %v; want the redacted reply", replay, err)
	}
	if h := replay.Header(); h.Get("X-Charge-Token") != "" || h.Get("X-Region") != "eu" || !idemkey.ParseReplayed(h.Values(idemkey.ReplayedHeader)) {
		t.Fatalf("replayed header %v, want X-Region alone, marked replayed", h)
	}
}

// A redaction that panics records Internal in place of the reply: the
// handler has run, so its key is not released. The log says what failed,
// and never quotes the panic's value, a string or an error, which may quote
// the reply it was redacting.
func TestRedactionThatPanics(t *testing.T) {
	logger, logs := logtest.New()
	runs := &counter{}
	redact := func(_ context.Context, _ string, r *idemconnect.Reply) {
		charge := r.Response.(*paymentsv1.Charge)
		if charge.GetAmount() == 100 {
			panic("cannot redact " + charge.GetDescription())
		}
		panic(errors.New("cannot redact " + charge.GetDescription()))
	}
	url := serve(t, runs.handle, newInterceptor(t, single(t, engine.WithLogger(logger)), idemconnect.WithRedaction(redact)))
	client := newChargeClient(t, url)
	for _, amount := range []int64{100, 200} { // a string, an error
		for range 2 { // the call, and its retry, which gets the record
			_, err := call(t.Context(), client, fmt.Sprint("k", amount), &paymentsv1.CreateChargeRequest{Amount: amount, Description: "card 4242"})
			if connect.CodeOf(err) != connect.CodeInternal || strings.Contains(err.Error(), "4242") {
				t.Fatalf("got %v, want Internal, not quoting the reply", err)
			}
		}
	}
	runs.wantRuns(t, 2)
	if !strings.Contains(logs.String(), "redaction function panicked") {
		t.Fatalf("the log does not say what failed:\n%s", logs)
	}
	if strings.Contains(logs.String(), "4242") {
		t.Fatalf("the log quotes the panic's value:\n%s", logs)
	}
}

// A record that does not open answers Unavailable with the store's reason,
// over each of Connect's protocols.
func TestUnopenedRecord(t *testing.T) {
	st := memory.New()
	runs := &counter{}
	writer := newChargeClient(t, serve(t, runs.handle, newInterceptor(t, newEngine(t, st, engine.WithSingleTenant(), engine.WithSealer(sealtest.Ring(t, 1))))))
	reader := serve(t, runs.handle, newInterceptor(t, newEngine(t, st, engine.WithSingleTenant(), engine.WithSealer(sealtest.Ring(t, 2)), engine.WithLogger(nil))))
	req := &paymentsv1.CreateChargeRequest{Amount: 100}
	if _, err := call(t.Context(), writer, "k1", req); err != nil {
		t.Fatal(err)
	}
	for _, opts := range [][]connect.ClientOption{nil, {connect.WithGRPC()}, {connect.WithGRPCWeb()}, {connect.WithProtoJSON()}} {
		_, err := call(t.Context(), newChargeClient(t, reader, opts...), "k1", req)
		if connect.CodeOf(err) != connect.CodeUnavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
			t.Fatalf("got %v (reason %q), want Unavailable, %s", err, idemkey.Reason(err), idemkey.ReasonStoreUnavailable)
		}
		var ce *connect.Error
		if errors.As(err, &ce) && idemkey.ParseReplayed(ce.Meta().Values(idemkey.ReplayedHeader)) {
			t.Fatal("the refusal is marked replayed")
		}
	}
	runs.wantRuns(t, 1)
}
