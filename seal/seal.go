package seal

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"unicode"
	"unicode/utf8"

	"github.com/idemkey/idemkey/store"
)

// KeySize is the size of a key: AES-256's.
const KeySize = 32

// Overhead is how many bytes sealing adds: header (8), nonce (12), tag (16).
const Overhead = headerSize + nonceSize + tagSize

const (
	headerSize = 8 // magic and version (4), key id (4)
	nonceSize  = 12
	tagSize    = 16
)

// magic starts every sealed record; no protobuf message starts with 0x00.
var magic = [4]byte{0x00, 'i', 'k', 0x01}

// Errors of Open, for errors.Is; their text names at most the key id.
var (
	// ErrUnknownKey: sealed with a key the ring does not hold (yet, or any more).
	ErrUnknownKey = errors.New("idemkey/seal: the record was sealed with a key the key ring does not hold")
	// ErrNotAuthentic: altered, truncated, or copied from another key's record.
	ErrNotAuthentic = errors.New("idemkey/seal: the record does not open: it was altered, or copied from another key's record")
	// ErrUnsealed: not sealed, and the ring is not WithUnsealedAccepted.
	ErrUnsealed = errors.New("idemkey/seal: the record is not sealed, and unsealed records are refused (seal.WithUnsealedAccepted)")
)

// KeyRing seals with its primary key and opens with any; safe for concurrent use.
type KeyRing struct {
	primary        *ringKey
	keys           map[[4]byte]*ringKey
	order          []*ringKey // the primary first, then the previous keys as given
	acceptUnsealed bool
}

type ringKey struct {
	id   [4]byte
	aead cipher.AEAD // prepends a random nonce
}

// Option configures a KeyRing.
type Option func(*ringOptions)

type ringOptions struct {
	previous       [][]byte
	acceptUnsealed bool
}

// WithPreviousKeys adds keys that open records but never seal.
func WithPreviousKeys(keys ...[]byte) Option {
	return func(o *ringOptions) { o.previous = append(o.previous, keys...) }
}

// WithUnsealedAccepted makes Open return an unsealed record as it is.
func WithUnsealedAccepted() Option {
	return func(o *ringOptions) { o.acceptUnsealed = true }
}

// NewKeyRing returns a key ring that seals with primary. Every key must be
// KeySize bytes, not all zero; the ring keeps no reference to the slices.
func NewKeyRing(primary []byte, opts ...Option) (*KeyRing, error) {
	var o ringOptions
	for _, opt := range opts {
		opt(&o)
	}
	r := &KeyRing{keys: map[[4]byte]*ringKey{}, acceptUnsealed: o.acceptUnsealed}
	var err error
	if r.primary, err = r.add(primary, "the primary key"); err != nil {
		return nil, err
	}
	for i, k := range o.previous {
		if _, err := r.add(k, fmt.Sprintf("previous key %d", i+1)); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// add adds key, or returns the same key already there.
func (r *KeyRing) add(key []byte, name string) (*ringKey, error) {
	if err := checkKey(key); err != nil {
		return nil, fmt.Errorf("idemkey/seal: %s: %w", name, err)
	}
	id := keyID(key)
	if k, ok := r.keys[id]; ok {
		// The same key again is harmless; another key with the same id
		// (one chance in 2^32) could not be told apart.
		if !k.same(key) {
			return nil, fmt.Errorf("idemkey/seal: %s has the key id %x of another key of the ring: make a new key", name, id)
		}
		return k, nil
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("idemkey/seal: %s: %w", name, err)
	}
	aead, err := cipher.NewGCMWithRandomNonce(block)
	if err != nil {
		return nil, fmt.Errorf("idemkey/seal: %s: %w", name, err)
	}
	k := &ringKey{id: id, aead: aead}
	r.keys[id] = k
	r.order = append(r.order, k)
	return k, nil
}

// same reports whether key is k's: k keeps no copy, so it opens a probe.
func (k *ringKey) same(key []byte) bool {
	block, _ := aes.NewCipher(key) // checked by add
	aead, _ := cipher.NewGCMWithRandomNonce(block)
	probe := aead.Seal(nil, nil, nil, nil)
	_, err := k.aead.Open(nil, nil, probe, nil)
	return err == nil
}

func checkKey(key []byte) error {
	if len(key) != KeySize {
		return fmt.Errorf("a key is %d bytes, not %d", KeySize, len(key))
	}
	if bytes.Equal(key, make([]byte, KeySize)) {
		return errors.New("the key is all zero bytes; " + makeKey)
	}
	return nil
}

func keyID(key []byte) [4]byte {
	sum := sha256.Sum256(append([]byte("idemkey seal key id\x00"), key...))
	return [4]byte(sum[:4])
}

// KeyID returns the id sealed records carry for key: 8 hex digits of a hash.
func KeyID(key []byte) (string, error) {
	if err := checkKey(key); err != nil {
		return "", fmt.Errorf("idemkey/seal: %w", err)
	}
	id := keyID(key)
	return hex.EncodeToString(id[:]), nil
}

// PrimaryKeyID is the id of the key new records are sealed with.
func (r *KeyRing) PrimaryKeyID() string { return hex.EncodeToString(r.primary.id[:]) }

// KeyIDs are the ids of the ring's keys, the primary first.
func (r *KeyRing) KeyIDs() []string {
	ids := make([]string, len(r.order))
	for i, k := range r.order {
		ids[i] = hex.EncodeToString(k.id[:])
	}
	return ids
}

// Overhead is how many bytes Seal adds: the package's Overhead.
func (r *KeyRing) Overhead() int { return Overhead }

// Seal seals outcome with the primary key for key's record; never an error.
func (r *KeyRing) Seal(key store.Key, outcome []byte) ([]byte, error) {
	out := make([]byte, headerSize, len(outcome)+Overhead)
	copy(out, magic[:])
	copy(out[len(magic):], r.primary.id[:])
	return r.primary.aead.Seal(out, nil, outcome, additionalData(out[:headerSize], key)), nil
}

// Open returns the outcome Seal sealed for key, in memory of its own; its
// errors match ErrUnknownKey, ErrNotAuthentic or ErrUnsealed.
func (r *KeyRing) Open(key store.Key, record []byte) ([]byte, error) {
	id, sealed := keyIDOf(record)
	if !sealed {
		if r.acceptUnsealed {
			return record, nil
		}
		return nil, ErrUnsealed
	}
	k, ok := r.keys[id]
	if !ok {
		return nil, fmt.Errorf("%w: key id %x", ErrUnknownKey, id)
	}
	if len(record) < Overhead {
		return nil, fmt.Errorf("%w: key id %x: %d bytes, fewer than an empty outcome's %d", ErrNotAuthentic, id, len(record), Overhead)
	}
	outcome, err := k.aead.Open(nil, nil, record[headerSize:], additionalData(record[:headerSize], key))
	if err != nil {
		return nil, fmt.Errorf("%w: key id %x", ErrNotAuthentic, id)
	}
	if outcome == nil {
		outcome = []byte{} // an empty outcome is still an outcome
	}
	return outcome, nil
}

// additionalData binds a record to its header and its key.
func additionalData(header []byte, key store.Key) []byte {
	return append(append(make([]byte, 0, headerSize+len(key)), header...), key[:]...)
}

// SealedWith reports whether record is sealed, and its key id, unopened.
func SealedWith(record []byte) (keyID string, sealed bool) {
	id, sealed := keyIDOf(record)
	if !sealed {
		return "", false
	}
	return hex.EncodeToString(id[:]), true
}

// keyIDOf reads a sealed record's key id; 0 if it is too short to hold one.
func keyIDOf(record []byte) (id [4]byte, sealed bool) {
	if !bytes.HasPrefix(record, magic[:]) {
		return id, false
	}
	if len(record) >= headerSize {
		id = [4]byte(record[len(magic):headerSize])
	}
	return id, true
}

// makeKey ends every error about a key's content.
const makeKey = "make a key with head -c 32 /dev/urandom > seal.key, or openssl rand -hex 32 > seal.key"

// ReadKeyFile reads a key file as DecodeKey; the error never holds content.
func ReadKeyFile(path string) ([]byte, error) {
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("idemkey/seal: %w; %s", err, makeKey)
	}
	if err != nil {
		return nil, fmt.Errorf("idemkey/seal: %w", err)
	}
	key, err := DecodeKey(raw)
	if err != nil {
		return nil, fmt.Errorf("idemkey/seal: %s: %w", path, err)
	}
	return key, nil
}

// DecodeKey reads a key file's content: 64 hex digits or base64, or KeySize
// bytes that are not text. The error never holds raw's content.
func DecodeKey(raw []byte) ([]byte, error) {
	if !isText(raw) {
		if len(raw) != KeySize {
			return nil, fmt.Errorf("want %d random bytes, or their hex or base64; found %d bytes that are not text; %s", KeySize, len(raw), makeKey)
		}
		if err := checkKey(raw); err != nil {
			return nil, err
		}
		return bytes.Clone(raw), nil
	}
	text := string(bytes.TrimSpace(raw))
	var key []byte
	var err error
	switch len(text) {
	case 0:
		return nil, errors.New("empty, or only white space; " + makeKey)
	case hex.EncodedLen(KeySize):
		key, err = hex.DecodeString(text)
	case base64.StdEncoding.EncodedLen(KeySize):
		key, err = base64.StdEncoding.DecodeString(text)
	}
	if err != nil || len(key) != KeySize {
		// Not the decoding error: hex's quotes the byte it stopped at.
		return nil, fmt.Errorf("want 64 hex digits or the standard base64 of %d bytes; found %d characters of other text; %s", KeySize, utf8.RuneCountInString(text), makeKey)
	}
	if err := checkKey(key); err != nil {
		return nil, err
	}
	return key, nil
}

// isText reports whether raw is printable UTF-8, as 32 random bytes are about once in 5*10^10.
func isText(raw []byte) bool {
	if !utf8.Valid(raw) {
		return false
	}
	for _, r := range string(raw) {
		if !unicode.IsPrint(r) && !unicode.IsSpace(r) {
			return false
		}
	}
	return true
}
