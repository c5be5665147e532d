package example_test

// This file is docs/outbox.md's snippet, between the markers; the page's
// copy must match it (TestREADMESnippets).

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/outbox"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/natstest"
)

// readme:outbox
// announcingLedger writes each charge and its announcement in the call's
// transaction (atomic mode): both commit with the key's record, or neither.
type announcingLedger struct {
	paymentsv1.UnimplementedPaymentServiceServer
	outbox *outbox.Outbox // outbox.New(st), st the engine's *postgres.Store
}

func (l *announcingLedger) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	tx, ok := postgres.TxFromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Unavailable, "CreateCharge must run in atomic mode")
	}
	c := &paymentsv1.Charge{Id: "ch_" + idemkey.NewKey(), Amount: req.GetAmount(), Currency: req.GetCurrency()}
	if _, err := tx.Exec(ctx, `INSERT INTO payments (id, amount, currency) VALUES ($1, $2, $3)`, c.Id, c.Amount, c.Currency); err != nil {
		return nil, status.Error(codes.Unavailable, "charge not written")
	}
	body, err := protojson.Marshal(c)
	if err == nil { // the message's id derives from the call's key
		err = l.outbox.Publish(ctx, outbox.Message{Destination: "payments.charge.created", Payload: body})
	}
	if err != nil { // Unavailable rolls the charge back with its message
		return nil, status.Error(codes.Unavailable, "charge not announced")
	}
	return c, nil
}

// relayCharges sends each committed announcement to NATS JetStream, its id
// as the Nats-Msg-Id, until ctx ends.
func relayCharges(ctx context.Context, ob *outbox.Outbox, js jetstream.JetStream) error {
	pub, err := idemnats.NewPublisher(js)
	if err != nil {
		return err
	}
	relay, err := ob.Relay(pub)
	if err != nil {
		return err
	}
	return relay.Run(ctx)
}

// end readme

// TestREADMEOutbox runs the snippet on a NATS server of its own: a charge
// retried with its key is one charge and one message, with the id derived
// from the key; a charge whose call fails after its write leaves neither.
func TestREADMEOutbox(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, js := natstest.Start(t).Connect(t)
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "CHARGES", Subjects: []string{"payments.charge.created"}})
	if err != nil {
		t.Fatal(err)
	}
	st, pool := paymentsStore(t)
	ob, err := outbox.New(st)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := engine.New(st, engine.WithSingleTenant())
	if err != nil {
		t.Fatal(err)
	}
	method := paymentsv1.PaymentService_CreateCharge_FullMethodName
	idem, err := interceptor.UnaryServerInterceptor(eng, interceptor.WithAtomicMethods(method))
	if err != nil {
		t.Fatal(err)
	}
	relayed := make(chan error, 1)
	go func() { relayed <- relayCharges(ctx, ob, js) }()

	l := &announcingLedger{outbox: ob}
	call := func(key string, handler grpc.UnaryHandler) error {
		kctx := metadata.NewIncomingContext(ctx, metadata.Pairs(idemkey.KeyMetadata, key))
		_, err := idem(kctx, readmeCharge, &grpc.UnaryServerInfo{FullMethod: method}, handler)
		return err
	}
	charge := func(ctx context.Context, req any) (any, error) {
		return l.CreateCharge(ctx, req.(*paymentsv1.CreateChargeRequest))
	}
	for range 3 { // a retry replays the first charge
		if err := call("order-1001", charge); err != nil {
			t.Fatal(err)
		}
	}
	failing := func(ctx context.Context, req any) (any, error) {
		if _, err := charge(ctx, req); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.Unavailable, "the ledger failed after the charge")
	}
	if err := call("order-1002", failing); status.Code(err) != codes.Unavailable {
		t.Fatalf("the failing call: %v, want Unavailable", err)
	}

	for n, _, err := st.PendingMessages(ctx); n != 0 || err != nil; n, _, err = st.PendingMessages(ctx) {
		if ctx.Err() != nil {
			t.Fatalf("%d messages unsent: %v", n, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("%d messages in the stream, want 1 (the first key's)", info.State.Msgs)
	}
	msg, err := stream.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := msg.Header.Get(jetstream.MsgIDHeader), idemkey.DeriveKey("", method, "order-1001", "outbox message 1"); got != want {
		t.Errorf("Nats-Msg-Id %q, want %q", got, want)
	}
	var payments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&payments); err != nil || payments != 1 {
		t.Errorf("%d payments (%v), want 1", payments, err)
	}
	cancel()
	if err := <-relayed; !errors.Is(err, context.Canceled) {
		t.Errorf("relay: %v", err)
	}
}
