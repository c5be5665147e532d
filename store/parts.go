package store

import "encoding/binary"

// AppendParts appends each part after its length, so that no two sequences
// share an encoding. Stored hashes depend on it: it never changes.
func AppendParts(b []byte, parts ...string) []byte {
	for _, p := range parts {
		b = binary.BigEndian.AppendUint64(b, uint64(len(p)))
		b = append(b, p...)
	}
	return b
}
