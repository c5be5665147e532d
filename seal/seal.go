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

// Overhead is how many bytes sealing adds to an outcome: the envelope's
// header (8), its nonce (12) and the tag (16).
const Overhead = headerSize + nonceSize + tagSize

const (
	headerSize = 8 // magic and version (4), key id (4)
	nonceSize  = 12
	tagSize    = 16
)

// magic starts every sealed record: version 1 of the envelope. Its first
// byte, 0x00, starts no protobuf message (field number 0 is invalid) and no
// consumer record.
var magic = [4]byte{0x00, 'i', 'k', 0x01}

// Errors of Open, matched with errors.Is. Their text names the key id at
// most, never a key or anything of the outcome.
var (
	// ErrUnknownKey: the record was sealed with a key the ring does not
	// hold (a key not yet given to this replica, or one dropped too soon).
	ErrUnknownKey = errors.New("idemkey/seal: the record was sealed with a key the key ring does not hold")
	// ErrNotAuthentic: the record does not open with the key it names: it
	// was altered or truncated, or copied from another key's record.
	ErrNotAuthentic = errors.New("idemkey/seal: the record does not open: it was altered, or copied from another key's record")
	// ErrUnsealed: the record is not sealed, and the ring was not built
	// WithUnsealedAccepted.
	ErrUnsealed = errors.New("idemkey/seal: the record is not sealed, and unsealed records are refused (seal.WithUnsealedAccepted)")
)

// KeyRing seals outcomes with its primary key and opens those sealed with
// any of its keys. It is safe for concurrent use, and implements
// engine.Sealer.
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

// WithPreviousKeys adds keys that open records but never seal: the keys
// that were primary before. See "Rotating keys" in the package
// documentation.
func WithPreviousKeys(keys ...[]byte) Option {
	return func(o *ringOptions) { o.previous = append(o.previous, keys...) }
}

// WithUnsealedAccepted makes Open return a record that is not sealed as it
// is, instead of refusing it with ErrUnsealed: for one retention after
// sealing is turned on, so that records written before keep replaying. See
// "Records written before sealing was turned on" in the package
// documentation.
func WithUnsealedAccepted() Option {
	return func(o *ringOptions) { o.acceptUnsealed = true }
}

// NewKeyRing returns a key ring that seals with primary. Every key must be
// KeySize bytes and not all zero; a key given twice counts once. The ring
// keeps no reference to the slices given.
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

// add adds key to the ring, or returns the one already there.
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

// same reports whether key is k's key: k keeps no copy of it, so it seals
// a probe under key and opens it with k.
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

// KeyID returns the id that sealed records carry for key: 8 hex digits, the
// first 4 bytes of a SHA-256 of it. It tells which key sealed a record, and
// says nothing usable about the key. An error if key is not a valid key.
func KeyID(key []byte) (string, error) {
	if err := checkKey(key); err != nil {
		return "", fmt.Errorf("idemkey/seal: %w", err)
	}
	id := keyID(key)
	return hex.EncodeToString(id[:]), nil
}

// PrimaryKeyID is the id of the key new records are sealed with.
func (r *KeyRing) PrimaryKeyID() string { return hex.EncodeToString(r.primary.id[:]) }

// KeyIDs are the ids of every key of the ring, the primary one first, then
// the previous keys in the order given.
func (r *KeyRing) KeyIDs() []string {
	ids := make([]string, len(r.order))
	for i, k := range r.order {
		ids[i] = hex.EncodeToString(k.id[:])
	}
	return ids
}

// Overhead is how many bytes Seal adds: the package's Overhead.
func (r *KeyRing) Overhead() int { return Overhead }

// Seal returns outcome sealed with the primary key for the record of key.
// It does not modify outcome. Its error is always nil: it is there for
// engine.Sealer, which a sealer that calls a key service implements too.
func (r *KeyRing) Seal(key store.Key, outcome []byte) ([]byte, error) {
	out := make([]byte, headerSize, len(outcome)+Overhead)
	copy(out, magic[:])
	copy(out[len(magic):], r.primary.id[:])
	return r.primary.aead.Seal(out, nil, outcome, additionalData(out[:headerSize], key)), nil
}

// Open returns the outcome of a record that Seal sealed for key, with any key
// of the ring. Its errors match ErrUnknownKey, ErrNotAuthentic or
// ErrUnsealed; a record that is not sealed is returned as it is if the ring
// was built WithUnsealedAccepted. The outcome returned does not share
// memory with record.
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

// SealedWith reports whether record is sealed, and with which key id (as
// KeyID writes it), without opening it: for a tool that lists records, or
// an engine with no key ring.
func SealedWith(record []byte) (keyID string, sealed bool) {
	id, sealed := keyIDOf(record)
	if !sealed {
		return "", false
	}
	return hex.EncodeToString(id[:]), true
}

// keyIDOf reads the key id of a sealed record. A record that starts with
// the magic but is too short to hold a key id is sealed, with key id 0.
func keyIDOf(record []byte) (id [4]byte, sealed bool) {
	if !bytes.HasPrefix(record, magic[:]) {
		return id, false
	}
	if len(record) >= headerSize {
		id = [4]byte(record[len(magic):headerSize])
	}
	return id, true
}

// makeKey ends every error about a key's content: how to make one that
// reads.
const makeKey = "make a key with head -c 32 /dev/urandom > seal.key, or openssl rand -hex 32 > seal.key"

// ReadKeyFile reads a key from the file at path, as DecodeKey reads its
// content. The error never holds the file's content.
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

// DecodeKey reads a key from the content of a key file. Text (white space
// around it aside) is read as 64 hex digits or the standard base64 of
// KeySize bytes, and refused otherwise: a password, or 32 hex digits, is
// not a key even when it is KeySize bytes long. Anything else must be
// exactly KeySize bytes, as head -c 32 /dev/urandom writes them. The error
// never holds raw's content; the key returned does not share memory with
// it.
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

// isText reports whether raw is UTF-8 text: printable characters and white
// space. 32 random bytes are text by chance with a probability of about
// 2*10^-11 (printable ASCII alone, (95/256)^32, would be 2*10^-14; the other
// characters of UTF-8 and white space add the rest), so a key that head -c
// 32 /dev/urandom made is all but never refused as text, and one that is
// gets the advice to make another.
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
