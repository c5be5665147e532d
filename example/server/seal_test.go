package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/seal"
)

// keyFile writes a new random key, in hex, to a file and returns its path
// and the key's id.
func keyFile(t *testing.T, name string) (path, id string) {
	t.Helper()
	key := make([]byte, seal.KeySize)
	rand.Read(key)
	path = filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(hex.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	id, err := seal.KeyID(key)
	if err != nil {
		t.Fatal(err)
	}
	return path, id
}

// With -seal-key the replies recorded in PostgreSQL are sealed: the table
// holds no plaintext of them. A server restarted with a new key, and the
// old one as -seal-previous-key, replays them; one with the new key alone
// answers Unavailable and charges nothing again. In both modes.
func TestSealedReplies(t *testing.T) {
	for _, atomic := range []string{"-atomic=true", "-atomic=false"} {
		t.Run(atomic, func(t *testing.T) {
			t.Parallel()
			bin := servertest.Build(t)
			schema := pgtest.Schema(t)
			url := pgtest.SchemaURL(schema)
			oldKey, oldID := keyFile(t, "old.key")
			newKey, newID := keyFile(t, "new.key")
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_sealed_alice", Amount: 4242, Currency: "EUR", Description: "card ending 4242"}

			a := servertest.Start(t, bin, "-database-url", url, atomic, "-seal-key", oldKey)
			first, _, err := create(a, key, req)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(a.Logs(), "sealing=\"key "+oldID+"\"") {
				t.Errorf("the server does not log its key id:\n%s", a.Logs())
			}
			pool := pgtest.Pool(t, schema)
			var outcome []byte
			if err := pool.QueryRow(context.Background(), `SELECT outcome FROM idempotency_keys`).Scan(&outcome); err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(outcome, []byte("cus_sealed_alice")) || bytes.Contains(outcome, []byte("ending 4242")) || bytes.Contains(outcome, []byte(first.GetId())) {
				t.Fatalf("the table holds the reply in the clear: %q", outcome)
			}
			if err := a.Kill(); err != nil {
				t.Fatal(err)
			}

			rotated := servertest.Start(t, bin, "-database-url", url, atomic, "-seal-key", newKey, "-seal-previous-key", oldKey)
			again, trailer, err := create(rotated, key, req)
			if err != nil || !proto.Equal(again, first) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Fatalf("after the rotation: %v, %v (replayed %v); want the first reply replayed", again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
			if !strings.Contains(rotated.Logs(), "sealing=\"key "+newID+", opening "+oldID+" too\"") {
				t.Errorf("the server does not log its key ids:\n%s", rotated.Logs())
			}
			if err := rotated.Kill(); err != nil {
				t.Fatal(err)
			}

			dropped := servertest.Start(t, bin, "-database-url", url, atomic, "-seal-key", newKey)
			_, _, err = create(dropped, key, req)
			if idemkey.Reason(err) != idemkey.ReasonStoreUnavailable || !strings.Contains(err.Error(), "Unavailable") {
				t.Fatalf("without the old key: %v, want Unavailable (%s)", err, idemkey.ReasonStoreUnavailable)
			}
			if n := count(t, pool, "charges"); n != 1 {
				t.Fatalf("%d charges, want 1", n)
			}
			// The server's log reaches the test through a pipe: on a busy
			// machine, after the call's answer.
			waitUntil(t, "the server logs the record that does not open", func() bool { return strings.Contains(dropped.Logs(), "does not open") })
			logs := dropped.Logs()
			if !strings.Contains(logs, "level=ERROR") || !strings.Contains(logs, "does not open") || strings.Contains(logs, key) || strings.Contains(logs, "acme") {
				t.Fatalf("want an Error log naming neither key nor tenant:\n%s", logs)
			}
		})
	}
}

// Bad key files stop the server at start-up, saying which flag.
func TestSealKeyRefused(t *testing.T) {
	short := filepath.Join(t.TempDir(), "short.key")
	if err := os.WriteFile(short, []byte("0123"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A 32-character password is text, not a key, however long.
	password := filepath.Join(t.TempDir(), "password.key")
	if err := os.WriteFile(password, []byte("correct horse battery staple 42!"), 0o600); err != nil {
		t.Fatal(err)
	}
	good, _ := keyFile(t, "good.key")
	for _, tc := range []struct {
		cfg  config
		want string
	}{
		{config{sealKey: short}, "-seal-key"},
		{config{sealKey: password}, "head -c 32 /dev/urandom"},
		{config{sealKey: filepath.Join(t.TempDir(), "missing")}, "-seal-key"},
		{config{sealKey: good, previousKeys: []string{short}}, "-seal-previous-key"},
		{config{previousKeys: []string{good}}, "need -seal-key"},
	} {
		if _, err := keyRing(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error naming %s", tc.cfg, err, tc.want)
		}
	}
}
