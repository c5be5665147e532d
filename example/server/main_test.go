package main

import (
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The server creates its tables on an empty database, answers over loopback,
// stops on its context, and a second run on the same database replays the
// first run's reply.
func TestRunOnPostgres(t *testing.T) {
	url := pgtest.SchemaURL(pgtest.Schema(t))
	key := idemkey.NewKey()
	req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
	call := func() (*paymentsv1.Charge, metadata.MD) {
		t.Helper()
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- run(ctx, lis, url, 0, time.Hour, slog.New(slog.DiscardHandler)) }()
		defer func() {
			stop()
			if err := <-done; err != nil {
				t.Errorf("run: %v", err)
			}
		}()
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		callCtx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		charge, err := paymentsv1.NewPaymentServiceClient(conn).CreateCharge(callCtx, req, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatalf("CreateCharge: %v", err)
		}
		return charge, trailer
	}
	first, trailer := call()
	if idemkey.Replayed(trailer) {
		t.Fatal("the first call was replayed")
	}
	again, trailer := call()
	if !proto.Equal(first, again) || !idemkey.Replayed(trailer) {
		t.Errorf("after a restart: %v (replayed %v), want the first run's %v, replayed", again, idemkey.Replayed(trailer), first)
	}
}
