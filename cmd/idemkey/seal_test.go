package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/seal"
)

// writeKey writes a key file of bytes b, in hex, and returns its path.
func writeKey(t *testing.T, b byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), fmt.Sprintf("seal-%d.key", b))
	if err := os.WriteFile(path, []byte(hex.EncodeToString(bytes.Repeat([]byte{b}, seal.KeySize))+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// A sealed record is inspected and forgotten as any other; its outcome is
// shown by key id and size, and opened with -seal-key (or, after a
// rotation, -seal-previous-key).
func TestSealedRecord(t *testing.T) {
	url, _, st := newStore(t)
	primary, other := writeKey(t, 1), writeKey(t, 2)
	key1, _ := seal.ReadKeyFile(primary)
	ring, err := seal.NewKeyRing(key1)
	if err != nil {
		t.Fatal(err)
	}
	eng := grpctest.Must(engine.New(st, engine.WithTenant(bearerTenant), engine.WithSealer(ring)))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, &chargeService{})
	client := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, grpctest.Serve(t, srv)))
	const key = "order-sealed-1"
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
	charge, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: "cus_secret", Amount: 500, Currency: "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	scope := []string{"inspect", "-tenant", "acme", "-method", createCharge, "-key", key}

	stdout, _ := mustRun(t, exitOK, url, scope...)
	want := fmt.Sprintf("sealed with key %s, %d bytes: give -seal-key to read it", ring.PrimaryKeyID(), proto.Size(charge)+2+seal.Overhead)
	if !strings.Contains(stdout, "completed") || !strings.Contains(stdout, want) {
		t.Errorf("inspect without the key:\n%s\nwant %q", stdout, want)
	}
	var rec struct {
		Outcome struct {
			Kind       string
			Bytes      int
			SealedWith string `json:"sealed_with"`
			Error      string
		}
	}
	jsonOf(t, exitOK, url, &rec, scope...)
	if rec.Outcome.Kind != "sealed" || rec.Outcome.SealedWith != ring.PrimaryKeyID() {
		t.Errorf("inspect -json without the key: %+v", rec.Outcome)
	}

	for _, keys := range [][]string{{"-seal-key", primary}, {"-seal-key", other, "-seal-previous-key", primary}} {
		stdout, _ = mustRun(t, exitOK, url, append(scope, keys...)...)
		if want := fmt.Sprintf("response of %d bytes (sealed with key %s)", proto.Size(charge), ring.PrimaryKeyID()); !strings.Contains(stdout, want) {
			t.Errorf("inspect %v:\n%s\nwant %q", keys, stdout, want)
		}
	}
	stdout, _ = mustRun(t, exitOK, url, append(scope, "-seal-key", other)...)
	if !strings.Contains(stdout, "unreadable") || !strings.Contains(stdout, "key ring does not hold") {
		t.Errorf("inspect with another key:\n%s", stdout)
	}
	_, stderr := mustRun(t, exitUsage, url, append(scope, "-seal-key", filepath.Join(t.TempDir(), "missing"))...)
	if !strings.Contains(stderr, "missing") {
		t.Errorf("a missing key file: %s", stderr)
	}
	for _, out := range []string{stdout, stderr} {
		if strings.Contains(out, key) || strings.Contains(out, "cus_secret") || strings.Contains(out, strings.Repeat("01", 8)) {
			t.Errorf("the command printed a key, the tenant's data or the seal key:\n%s", out)
		}
	}

	scope[0] = "forget"
	stdout, _ = mustRun(t, exitOK, url, scope...)
	if !strings.Contains(stdout, "forgot record") {
		t.Errorf("forget says:\n%s", stdout)
	}
	mustRun(t, exitNotFound, url, append([]string{"inspect"}, scope[1:]...)...)
}
