package example_test

// This file is docs/operations.md's sealing snippet, between the markers;
// the page's copy must match it (TestREADMESnippets).

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/store/memory"
)

// readme:seal
import (
	"context"

	"google.golang.org/grpc"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
)

// newSealedServer seals every recorded reply with the key in keyFile (make
// one with head -c 32 /dev/urandom > seal.key), opens those sealed before
// with oldKeyFile's, and records no customer id.
func newSealedServer(st store.Store, keyFile, oldKeyFile string) (*grpc.Server, error) {
	key, err := seal.ReadKeyFile(keyFile)
	if err != nil {
		return nil, err
	}
	oldKey, err := seal.ReadKeyFile(oldKeyFile)
	if err != nil {
		return nil, err
	}
	ring, err := seal.NewKeyRing(key, seal.WithPreviousKeys(oldKey)) // oldKey opens, never seals
	if err != nil {
		return nil, err
	}
	eng, err := engine.New(st,
		engine.WithTenant(callerTenant),
		engine.WithSealer(ring)) // AES-256-GCM, bound to each record's key
	if err != nil {
		return nil, err
	}
	idem, err := interceptor.UnaryServerInterceptor(eng,
		interceptor.WithRedaction(func(_ context.Context, _ string, r *interceptor.Reply) {
			if c, ok := r.Response.(*paymentsv1.Charge); ok {
				c.CustomerId = "" // the first caller gets it; every retry gets the reply without it
			}
		}))
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(authInterceptor, idem))
	paymentsv1.RegisterPaymentServiceServer(srv, payments{})
	return srv, nil
}

// end readme

// The README's sealed server keeps no plaintext of a reply, replays it
// without the customer id, and opens a record of its previous key.
func TestREADMESeal(t *testing.T) {
	dir := t.TempDir()
	keyFile := func(name string) string {
		k := make([]byte, seal.KeySize)
		rand.Read(k)
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, k, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	oldFile, newFile := keyFile("old.key"), keyFile("new.key")
	st := memory.New()
	call := func(srv *grpc.Server, key string) (*paymentsv1.Charge, metadata.MD) {
		t.Helper()
		client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
		ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer acme", idemkey.KeyMetadata, key)
		var trailer metadata.MD
		c, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_alice", Amount: 1999, Currency: "EUR"}, grpc.Trailer(&trailer))
		if err != nil {
			t.Fatal(err)
		}
		return c, trailer
	}
	before, err := newSealedServer(st, oldFile, newFile) // the old key as primary
	if err != nil {
		t.Fatal(err)
	}
	first, _ := call(before, "order-1")
	if first.GetCustomerId() != "cus_alice" {
		t.Fatalf("first call: %v, want the whole reply", first)
	}
	res, _, _ := st.Find(t.Context(), store.ScopeKey("acme", paymentsv1.PaymentService_CreateCharge_FullMethodName, "order-1"))
	if bytes.Contains(res.Outcome, []byte(first.GetId())) {
		t.Fatal("the store holds the reply in the clear")
	}
	after, err := newSealedServer(st, newFile, oldFile) // rotated
	if err != nil {
		t.Fatal(err)
	}
	replay, trailer := call(after, "order-1")
	if replay.GetId() != first.GetId() || replay.GetCustomerId() != "" || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
		t.Fatalf("replay after the rotation: %v, want %s without its customer id, replayed", replay, first.GetId())
	}
}
