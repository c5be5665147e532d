package main

import (
	"bytes"
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/store/memory"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The demo runs against the example server over loopback and checks every
// answer itself; its transcript shows the duplicate converging.
func TestDemo(t *testing.T) {
	srv, _ := example.NewServer(memory.New(), example.Config{HandlerDelay: time.Second})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	var out bytes.Buffer
	if err := run(context.Background(), lis.Addr().String(), "sk_test_acme", 5*time.Second, &out); err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	for _, want := range []string{
		"the server held the duplicate until the first call finished", // whichever of the two calls arrived second
		"OK [idempotent-replayed: true]",
		"InvalidArgument IDEMPOTENCY_KEY_REUSED",
		"InvalidArgument IDEMPOTENCY_KEY_MISSING",
		"FailedPrecondition: card declined [idempotent-replayed: true]",
		"cus_alice has 1 charge(s)",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("transcript lacks %q:\n%s", want, out.String())
		}
	}
}
