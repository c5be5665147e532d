package outbox

// Encode and Decode are the body's encoding, for the round-trip test and
// FuzzDecode.
var (
	Encode = encode
	Decode = decode
)
