package protokey

import (
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/internal/protohash"
	"github.com/idemkey/idemkey/store"
)

// HashRequest is the SHA-256 of the full method name, with its length in
// front, followed by the canonical encoding of req: the default fingerprint
// of the gRPC and Connect adapters, so that one request fingerprints the same
// over either. Every request has one, so the error is always nil.
//
// The canonical encoding of a message is its wire encoding with:
//   - every field, known or unknown (GetUnknown), in ascending order of field
//     number, a known field before an unknown one of the same number, the
//     values of one field in their order;
//   - a known field (a set extension too) as protobuf-go's deterministic
//     marshalling writes it: a singular field only if set (Has), so a proto3
//     default contributes nothing; varints minimal; repeated scalars packed
//     or not as the field's descriptor says; map entries sorted by key (false
//     before true, integers numerically, strings bytewise), each with its key
//     (field 1) and value (field 2); messages and groups in their canonical
//     encoding;
//   - an unknown field's tag, its VARINT value and the length of its LEN value
//     written as minimal varints; I32, I64, LEN and group values as they came;
//     bytes that do not parse as a field, which protobuf-go never leaves,
//     appended as they are.
//
// So:
//   - any two encodings of one request read with one schema fingerprint the
//     same: fields in any order, repeated scalars packed, unpacked or in
//     several runs, padded varints, unknown fields in any order (each
//     number's values in theirs), map entries in any order, a singular field
//     sent again (the last one counts), a message sent in parts;
//   - a server with an older schema, which reads a newer field as unknown,
//     fingerprints a request as a newer server does if the client encoded the
//     field canonically, as protobuf's encoders do a scalar, a string or
//     bytes, a packed repeated scalar, or a message without maps or oneofs.
//     Not a map, whose entries an encoder may write in any order;
//   - a request that differs in a field the server reads, or in an unknown
//     field's value, fingerprints differently;
//   - if a message and its sub-messages have no unknown fields, no extensions
//     set, and no oneof field set numbered below another field set (protobuf-go
//     writes extensions first and oneof fields last), its canonical encoding
//     is proto.MarshalOptions{Deterministic: true}.Marshal: such a request
//     fingerprints as in releases that hashed that marshalling, so their
//     records still match it.
func HashRequest(fullMethod string, req proto.Message) (store.Fingerprint, error) {
	return protohash.Hash(fullMethod, req, nil), nil
}
