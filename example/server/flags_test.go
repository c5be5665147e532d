package main

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/servertest"
)

// A flag that makes no sense stops the server before it listens: the
// process exits with a non-zero status and a message that names the flag,
// and never serves.
func TestBadFlagsRefused(t *testing.T) {
	bin := servertest.Build(t)
	// The address is one this test holds: a server that listened before it
	// checked its flags would fail on it, and say so, rather than name the
	// flag.
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"-ttl", "-1h"}, "-ttl"},
		{[]string{"-ttl", "0"}, "-ttl"},
		{[]string{"-ttl", "5m"}, "-ttl"}, // shorter than the longest lease, 10m
		{[]string{"-ttl", "soon"}, "-ttl"},
		{[]string{"-region", "EU West"}, "-region"},
		// Shorter than -max-lease, 10m unless set: the message names the
		// flag that would let it serve.
		{[]string{"-ttl", "2s"}, "-max-lease"},
		{[]string{"-ttl", "2s", "-max-lease", "3s"}, "-max-lease"},
		{[]string{"-max-lease", "0"}, "-max-lease"},
		{[]string{"-max-lease", "-1s"}, "-max-lease"},
		{[]string{"-lease", "0"}, "-lease"},
		{[]string{"-lease", "-1s"}, "-lease"},
		{[]string{"-handler-delay", "-1s"}, "-handler-delay"},
		{[]string{"-processor-timeout", "0"}, "-processor-timeout"},
		{[]string{"-fail-after-charge", "-1"}, "-fail-after-charge"},
		{[]string{"-fail-after-write", "-1"}, "-fail-after-write"},
		// The outbox needs PostgreSQL: not memory, not Redis.
		{[]string{"-outbox", "nats://127.0.0.1:4222"}, "-outbox"},
		{[]string{"-outbox", "nats://127.0.0.1:4222", "-database-url", "postgres://127.0.0.1/test", "-redis-url", "redis://127.0.0.1:6379/0"}, "-outbox"},
		{[]string{"-outbox", "http://127.0.0.1:4222", "-database-url", "postgres://127.0.0.1/test"}, "-outbox"},
		{[]string{"-relay-only", "-database-url", "postgres://127.0.0.1/test"}, "-relay-only"},
		{[]string{"-outbox", "nats://127.0.0.1:4222", "-database-url", "postgres://127.0.0.1/test", "-atomic=false"}, "atomic mode"},
		// The shards are the store and the ledger: no other store beside
		// them, no outbox, no empty URL.
		{[]string{"-shard-database-urls", "postgres://127.0.0.1/a,postgres://127.0.0.1/b", "-database-url", "postgres://127.0.0.1/test"}, "-shard-database-urls"},
		{[]string{"-shard-database-urls", "postgres://127.0.0.1/a,postgres://127.0.0.1/b", "-outbox", "nats://127.0.0.1:4222"}, "-shard-database-urls"},
		{[]string{"-shard-database-urls", "postgres://127.0.0.1/a,postgres://127.0.0.1/b", "-idempotency=false"}, "-shard-database-urls"},
		{[]string{"-shard-database-urls", "postgres://127.0.0.1/a,"}, "-shard-database-urls"},
		{[]string{"-memory-max-bytes", "-1"}, "-memory-max-bytes"},
		{[]string{"-memory-max-bytes", "0"}, "-memory-max-bytes"},
		{[]string{"-memory-max-records", "-1"}, "-memory-max-records"},
		{[]string{"-memory-max-records", "0"}, "-memory-max-records"},
		// Shorter than -max-lease: the interceptor's refusal, under the
		// flag's name.
		{[]string{"-method-retention", createChargeOp + "=5m"}, "-method-retention"},
		{[]string{"-method-retention", createChargeOp + "=2s", "-max-lease", "3s"}, "-max-lease"},
		{[]string{"-method-retention", createChargeOp + "=0s"}, "-method-retention"},
		{[]string{"-method-retention", createChargeOp}, "-method-retention"},
		{[]string{"-method-retention", "CreateCharge=1h"}, "-method-retention"},
		// GetCharge is not covered unless -cover-method names it.
		{[]string{"-method-retention", getChargeOp + "=1h"}, "-cover-method"},
		{[]string{"-cover-method", "/example.payments.v1.PaymentService/Refund"}, "-cover-method"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			addrFile := filepath.Join(t.TempDir(), "addr")
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			args := append([]string{"-addr", held.Addr().String(), "-addr-file", addrFile, "-database-url="}, tc.args...)
			out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() <= 0 {
				t.Fatalf("the server ended with %v, want a non-zero exit status; it wrote:\n%s", err, out)
			}
			if !strings.Contains(string(out), tc.flag+" ") {
				t.Errorf("the server's message does not name %s:\n%s", tc.flag, out)
			}
			if strings.Contains(string(out), "listening") || strings.Contains(string(out), "address already in use") {
				t.Errorf("the server tried to listen before it refused %s:\n%s", tc.flag, out)
			}
			if _, err := os.Stat(addrFile); !os.IsNotExist(err) {
				t.Errorf("the server wrote its address file: %v", err)
			}
		})
	}
}
