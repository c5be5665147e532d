package seal_test

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
)

func newKey(t testing.TB) []byte {
	t.Helper()
	k := make([]byte, seal.KeySize)
	rand.Read(k)
	return k
}

func newRing(t testing.TB, primary []byte, opts ...seal.Option) *seal.KeyRing {
	t.Helper()
	r, err := seal.NewKeyRing(primary, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

var (
	keyA = store.ScopeKey("acme", "/pkg.S/M", "order-1")
	keyB = store.ScopeKey("acme", "/pkg.S/M", "order-2")
)

func TestSealOpen(t *testing.T) {
	r := newRing(t, newKey(t))
	for _, outcome := range [][]byte{{}, []byte("processed"), bytes.Repeat([]byte("card 4242 4242 4242 4242 "), 100)} {
		sealed, err := r.Seal(keyA, outcome)
		if err != nil {
			t.Fatal(err)
		}
		if len(sealed) != len(outcome)+seal.Overhead {
			t.Errorf("sealed %d bytes into %d, want %d more", len(outcome), len(sealed), seal.Overhead)
		}
		if len(outcome) > 8 && bytes.Contains(sealed, outcome[:8]) {
			t.Errorf("the sealed record holds the plaintext")
		}
		if id, ok := seal.SealedWith(sealed); !ok || id != r.PrimaryKeyID() {
			t.Errorf("SealedWith = %q, %v; want the primary key id %s", id, ok, r.PrimaryKeyID())
		}
		got, err := r.Open(keyA, sealed)
		if err != nil || !bytes.Equal(got, outcome) || got == nil {
			t.Fatalf("Open = %q, %v; want %q", got, err, outcome)
		}
		again, _ := r.Seal(keyA, outcome)
		if bytes.Equal(again, sealed) {
			t.Error("two seals of one outcome are equal: the nonce is not random")
		}
	}
}

func TestRecordBoundToItsKey(t *testing.T) {
	r := newRing(t, newKey(t))
	sealed, _ := r.Seal(keyA, []byte("ch_1"))
	if _, err := r.Open(keyB, sealed); !errors.Is(err, seal.ErrNotAuthentic) {
		t.Fatalf("a record copied to another key opened: %v", err)
	}
}

func TestTamperedRecordDoesNotOpen(t *testing.T) {
	r := newRing(t, newKey(t))
	sealed, _ := r.Seal(keyA, []byte("ch_1 for 1999 EUR"))
	for i := range sealed {
		for _, bit := range []byte{0x01, 0x80} {
			altered := bytes.Clone(sealed)
			altered[i] ^= bit
			if got, err := r.Open(keyA, altered); err == nil {
				t.Fatalf("byte %d altered (^%#x) opened as %q", i, bit, got)
			}
		}
	}
	for n := range len(sealed) {
		if _, err := r.Open(keyA, sealed[:n]); err == nil {
			t.Fatalf("truncated to %d bytes, the record opened", n)
		}
	}
	if _, err := r.Open(keyA, append(bytes.Clone(sealed), 0)); err == nil {
		t.Fatal("with a byte added, the record opened")
	}
}

func TestRotation(t *testing.T) {
	oldKey, newKeyBytes := newKey(t), newKey(t)
	old := newRing(t, oldKey)
	sealedOld, _ := old.Seal(keyA, []byte("before"))

	rotated := newRing(t, newKeyBytes, seal.WithPreviousKeys(oldKey))
	if got, err := rotated.Open(keyA, sealedOld); err != nil || string(got) != "before" {
		t.Fatalf("the rotated ring does not open a record of its previous key: %q, %v", got, err)
	}
	sealedNew, _ := rotated.Seal(keyA, []byte("after"))
	if id, _ := seal.SealedWith(sealedNew); id == mustID(t, oldKey) || id != mustID(t, newKeyBytes) {
		t.Fatalf("the rotated ring sealed with key %s, want the primary %s", id, mustID(t, newKeyBytes))
	}
	// A replica that has only the old key cannot open what the new one seals.
	if _, err := old.Open(keyA, sealedNew); !errors.Is(err, seal.ErrUnknownKey) || !strings.Contains(err.Error(), mustID(t, newKeyBytes)) {
		t.Fatalf("got %v, want ErrUnknownKey naming the key id", err)
	}
	if ids := rotated.KeyIDs(); !slices.Equal(ids, []string{mustID(t, newKeyBytes), mustID(t, oldKey)}) {
		t.Errorf("KeyIDs = %v", ids)
	}
}

func mustID(t *testing.T, key []byte) string {
	t.Helper()
	id, err := seal.KeyID(key)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func TestUnsealedRecords(t *testing.T) {
	key := newKey(t)
	plain := []byte("processed")
	if _, err := newRing(t, key).Open(keyA, plain); !errors.Is(err, seal.ErrUnsealed) {
		t.Fatalf("an unsealed record: %v, want ErrUnsealed", err)
	}
	got, err := newRing(t, key, seal.WithUnsealedAccepted()).Open(keyA, plain)
	if err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("WithUnsealedAccepted: %q, %v", got, err)
	}
	// Accepting unsealed records never lets a sealed one that does not open
	// through as plaintext.
	other, _ := newRing(t, newKey(t)).Seal(keyA, plain)
	if _, err := newRing(t, key, seal.WithUnsealedAccepted()).Open(keyA, other); !errors.Is(err, seal.ErrUnknownKey) {
		t.Fatalf("a record of an unknown key with WithUnsealedAccepted: %v", err)
	}
}

func TestNewKeyRingRefusesBadKeys(t *testing.T) {
	good := newKey(t)
	for name, tc := range map[string]struct {
		primary []byte
		opts    []seal.Option
	}{
		"nil primary":        {nil, nil},
		"short primary":      {good[:16], nil},
		"long primary":       {append(bytes.Clone(good), 1), nil},
		"zero primary":       {make([]byte, seal.KeySize), nil},
		"short previous key": {good, []seal.Option{seal.WithPreviousKeys(newKey(t)[:31])}},
	} {
		if _, err := seal.NewKeyRing(tc.primary, tc.opts...); err == nil {
			t.Errorf("%s: no error", name)
		} else if strings.Contains(err.Error(), hex.EncodeToString(good)) {
			t.Errorf("%s: the error holds the key: %v", name, err)
		}
	}
	r, err := seal.NewKeyRing(good, seal.WithPreviousKeys(good, bytes.Clone(good)))
	if err != nil || len(r.KeyIDs()) != 1 {
		t.Fatalf("a key given again: %v, %v; want it counted once", r, err)
	}
}

func TestRingKeepsNoReferenceToTheKey(t *testing.T) {
	key := newKey(t)
	r := newRing(t, key)
	sealed, _ := r.Seal(keyA, []byte("x"))
	clear(key)
	if _, err := r.Open(keyA, sealed); err != nil {
		t.Fatalf("clearing the caller's slice changed the ring: %v", err)
	}
}

// A key file holds 32 random bytes, or their hex or base64. Text that is
// neither, such as a password or a 32-digit hex string (16 bytes), is
// refused even when it happens to be 32 bytes long, and every refusal says
// how to make a key without quoting the file.
func TestReadKeyFile(t *testing.T) {
	key := newKey(t)
	dir := t.TempDir()
	for name, content := range map[string][]byte{
		"raw":                      key,
		"64 hex digits, a newline": []byte(hex.EncodeToString(key) + "\n"),
		"base64, a newline":        []byte(base64.StdEncoding.EncodeToString(key) + "\n"),
		"base64, white space":      []byte("  " + base64.StdEncoding.EncodeToString(key) + "\r\n"),
	} {
		path := filepath.Join(dir, "good")
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := seal.ReadKeyFile(path)
		if err != nil || !bytes.Equal(got, key) {
			t.Errorf("%s: %x, %v", name, got, err)
		}
		if got, err := seal.DecodeKey(content); err != nil || !bytes.Equal(got, key) {
			t.Errorf("%s: DecodeKey: %x, %v", name, got, err)
		}
	}
	password := "Tr0ub4dor&3 correct horse staple"
	passwordUTF8 := "schlüssel für die Kasse, 2024!"
	halfHex := hex.EncodeToString(key[:seal.KeySize/2])
	if len(password) != seal.KeySize || len(passwordUTF8) != seal.KeySize || len(halfHex) != seal.KeySize {
		t.Fatal("the passwords and the 32 hex digits must be 32 bytes, as a key is")
	}
	for name, content := range map[string][]byte{
		"a 32-character password":     []byte(password),
		"a 32-byte UTF-8 password":    []byte(passwordUTF8),
		"32 hex digits":               []byte(halfHex),
		"32 hex digits and a newline": []byte(halfHex + "\n"),
		"64 characters, not hex":      []byte(strings.Repeat("zq", seal.KeySize)),
		"base64 of 31 bytes":          []byte(base64.StdEncoding.EncodeToString(key[:31]) + "\n"),
		"raw with a newline":          append(bytes.Clone(key), '\n'),
		"short":                       key[:20],
		"empty":                       nil,
		"zero":                        make([]byte, seal.KeySize),
		"64 zero hex digits":          []byte(strings.Repeat("0", 2*seal.KeySize) + "\n"),
	} {
		path := filepath.Join(dir, "bad")
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := seal.ReadKeyFile(path)
		if err == nil {
			t.Errorf("%s: no error", name)
			continue
		}
		if !strings.Contains(err.Error(), "head -c 32 /dev/urandom") {
			t.Errorf("%s: the error does not say how to make a key: %v", name, err)
		}
		// The path is the test's temporary directory, with digits of its
		// own: leave it out.
		msg := strings.ReplaceAll(err.Error(), path, "")
		if quote := bytes.TrimSpace(content); len(quote) > 8 && strings.Contains(msg, string(quote[:8])) {
			t.Errorf("%s: the error quotes the file: %v", name, err)
		}
	}
	if _, err := seal.ReadKeyFile(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "head -c 32 /dev/urandom") {
		t.Errorf("a missing file: %v, want an error saying how to make a key", err)
	}
}

// FuzzOpen: no record read from a store makes Open panic, and none opens
// but one that Seal made (each fuzzing process seals "ch_1" anew, with a
// nonce of its own, under the same key).
func FuzzOpen(f *testing.F) {
	key := bytes.Repeat([]byte{7}, seal.KeySize)
	r, err := seal.NewKeyRing(key)
	if err != nil {
		f.Fatal(err)
	}
	sealed, _ := r.Seal(keyA, []byte("ch_1"))
	f.Add(sealed)
	f.Add([]byte("processed"))
	f.Add([]byte{0x00, 'i', 'k', 0x01})
	f.Fuzz(func(t *testing.T, record []byte) {
		got, err := r.Open(keyA, record)
		if err == nil && string(got) != "ch_1" {
			t.Fatalf("%x opened as %q", record, got)
		}
	})
}

// BenchmarkSeal measures sealing and opening a 1 KiB outcome, about a
// CreateCharge reply with a few addresses in it: what a first call and a
// replay each pay for sealing, beside the call's own cost.
func BenchmarkSeal(b *testing.B) {
	r, err := seal.NewKeyRing(newKey(b))
	if err != nil {
		b.Fatal(err)
	}
	outcome := make([]byte, 1024)
	rand.Read(outcome)
	sealed, _ := r.Seal(keyA, outcome)
	b.Run("op=seal/size=1KiB", func(b *testing.B) {
		b.SetBytes(int64(len(outcome)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := r.Seal(keyA, outcome); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("op=open/size=1KiB", func(b *testing.B) {
		b.SetBytes(int64(len(outcome)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := r.Open(keyA, sealed); err != nil {
				b.Fatal(err)
			}
		}
	})
}
