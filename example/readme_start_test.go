package example_test

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store/memory"
)

// This file is the README's first snippet, a server and a client, between
// the markers; the README's copy must match it (TestREADMESnippets).
// payments, authInterceptor, callerTenant and serviceConfig are in
// readme_use_test.go, which docs/grpc.md shows whole.

// readme:start
// Server: records each key's first reply and replays it to every retry.
func serveCharges(lis net.Listener) error {
	eng, err := engine.New(memory.New(), engine.WithTenant(callerTenant)) // one per process
	if err != nil {
		return err
	}
	idem, err := interceptor.UnaryServerInterceptor(eng)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, payments{})
	return srv.Serve(lis)
}

// Client: each call gets one key, which gRPC's retries (serviceConfig) resend.
func dialCharges(addr string) (*grpc.ClientConn, error) {
	keys, err := interceptor.UnaryClientInterceptor()
	if err != nil {
		return nil, err
	}
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(serviceConfig), grpc.WithUnaryInterceptor(keys))
}

// end readme

// The README's first server and client charge once, and a retry with the
// call's key gets the same charge back.
func TestREADMEStart(t *testing.T) {
	lis := listen(t)
	go serveCharges(lis)
	conn, err := dialCharges(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer acme")
	client := paymentsv1.NewPaymentServiceClient(conn)
	key := "order-start-1"
	first, err := client.CreateCharge(ctx, readmeCharge, interceptor.UseKey(key))
	if err != nil {
		t.Fatalf("CreateCharge: %v", err)
	}
	again, err := client.CreateCharge(ctx, readmeCharge, interceptor.UseKey(key))
	if err != nil {
		t.Fatalf("CreateCharge again: %v", err)
	}
	if first.GetId() == "" || again.GetId() != first.GetId() {
		t.Errorf("the retry's charge %q, want the first's %q", again.GetId(), first.GetId())
	}
}
