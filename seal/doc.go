// Package seal encrypts recorded outcomes at rest, so that a store's
// backups, replicas and operators cannot read the replies idemkey keeps
// (card fingerprints, addresses, credentials). A KeyRing seals each outcome
// with AES-256-GCM under its primary key, bound to the record's scope hash,
// and opens records sealed with any of its keys:
//
//	primary, err := seal.ReadKeyFile("/etc/payments/seal.key") // head -c 32 /dev/urandom > seal.key
//	ring, err := seal.NewKeyRing(primary, seal.WithPreviousKeys(previous))
//	eng, err := engine.New(st, engine.WithTenant(tenantOf), engine.WithSealer(ring))
//
// # Guarantees
//
// A store holds no plaintext of a sealed outcome; the rest of a record stays
// plain, for tools that lack the key. A record opens only unaltered, under
// its own scope, with a key the ring holds; one that does not is never
// replayed nor run again, even with engine.WithFailOpen.
//
// # Rotation
//
// WithPreviousKeys' keys open but never seal: give every replica the new key
// as a previous one, then make it the primary, and drop the old after one
// retention. Records written before sealing are refused (ErrUnsealed) unless
// WithUnsealedAccepted. docs/operations.md ("Sealing keys") has the steps.
//
// # Caveats
//
// The fingerprint is not bound: a writer of the table can make another
// request with the same key get a record's reply, but not make one up.
// Random 96-bit nonces bound one key to about 2^32 records. What a replay
// does not need is best not recorded at all (each adapter's WithRedaction).
package seal
