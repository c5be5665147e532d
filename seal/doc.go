// Package seal encrypts recorded outcomes at rest: the replies idemkey keeps
// to replay hold what handlers returned (card fingerprints, addresses,
// vended credentials), and a store's backups, replicas and operators need
// not read them.
//
// A KeyRing seals each outcome with AES-256-GCM (the standard library's,
// with a random nonce) under its primary key, bound to the record's scope
// hash (store.Key) as associated data, and opens records sealed with any of
// its keys. Give it to the engine with engine.WithSealer; the engine seals on
// the way to the store and opens on the way back, for every entry point
// built on it, on every store and in both modes.
//
// # Example
//
//	primary, err := seal.ReadKeyFile("/etc/payments/seal.key") // forms below
//	if err != nil { ... }
//	previous, err := seal.ReadKeyFile("/etc/payments/seal-previous.key")
//	if err != nil { ... }
//	ring, err := seal.NewKeyRing(primary, seal.WithPreviousKeys(previous))
//	if err != nil { ... }
//	eng, err := engine.New(st, engine.WithTenant(tenantOf), engine.WithSealer(ring))
//	if err != nil { ... }
//	idem, err := interceptor.UnaryServerInterceptor(eng)
//
// Make a key with `head -c 32 /dev/urandom > seal.key`, or `openssl rand
// -hex 32 > seal.key`, readable by the server alone. ReadKeyFile (and
// DecodeKey, for a key from elsewhere) reads a file in one of two forms:
//
//   - Text, white space around it aside: 64 hex digits, or the standard
//     base64 of 32 bytes. Any other text is refused, even 32 characters of
//     it: a password, or 32 hex digits (16 bytes), is not a key.
//   - Anything else: exactly 32 bytes, the key itself. Random bytes are
//     text by chance about once in 5*10^10 keys, and then refused as text.
//
// A key of all zero bytes is refused too. Every error says how to make a
// key, and none quotes the file.
//
// # Guarantees
//
//   - A store holds no plaintext of a sealed outcome: its bytes are the
//     envelope below. Only the outcome is sealed; the record's scope hash,
//     fingerprint, state and times stay as they are, so stores, the sweeper
//     and `idemkey inspect`/`forget` work without the key.
//   - A record opens only under the scope it was sealed for: a ciphertext
//     copied onto another key's record, or altered in any byte, does not
//     open. Nor does one sealed with a key the ring does not hold.
//   - A record that does not open is never replayed and never runs its
//     handler again. The engine answers as for a store that failed
//     (Unavailable, reason IDEMPOTENCY_STORE_UNAVAILABLE; HTTP 503; a
//     consumer negative-acknowledges, and dead-letters on the last
//     delivery), and logs at Error why, with the record's scope hash
//     prefix, never the key or the tenant; even engine.WithFailOpen does
//     not run the handler. Unavailable rather than a final error, because
//     the usual cause is a replica that lacks a key its peers already seal
//     with: a retry that reaches another replica gets the reply.
//
// # Rotating keys, and the format
//
// New records are sealed with the primary key; records sealed with a key
// given to WithPreviousKeys still open, and nothing is ever sealed with
// one. Each sealed record names its key by its KeyID, so a key file needs
// nothing else. To rotate: give every replica the new key as a previous
// key; then make it the primary, and the old one previous, everywhere;
// after one retention, drop the old key. A sealed record is an envelope of
// Overhead (36) bytes more than the outcome, part of the stored format the
// next release reads. The repository's docs/operations.md ("Sealing keys")
// has the rotation's steps and the envelope's layout.
//
// # Caveats
//
//   - The fingerprint is not bound: someone who can write the table can
//     change a completed record's fingerprint so that another request with
//     the same key gets its reply instead of "reused". They cannot make up a
//     reply, nor move one to another key.
//   - Random 96-bit nonces bound one key to about 2^32 sealed records;
//     rotate well before (at 1,000 new keys a second, that is 136 years).
//   - Redaction (each adapter's WithRedaction) is the other half: what is
//     not needed to replay a reply is best not recorded at all.
package seal
