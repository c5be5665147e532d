package store

import "encoding/binary"

// AppendParts appends each part with its length in front, so that no two
// sequences of parts share an encoding: the form of every hash idemkey
// stores or compares (ScopeKey, idemkey.DeriveKey, a fingerprint bound to its
// operation). Records depend on it, so it never changes.
func AppendParts(b []byte, parts ...string) []byte {
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}
