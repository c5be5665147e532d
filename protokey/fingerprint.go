package protokey

import (
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey/internal/protohash"
	"github.com/idemkey/idemkey/store"
)

// HashRequest is the default fingerprint of the gRPC and Connect adapters,
// the same for one request over either: the SHA-256 of the full method and
// req's canonical encoding (docs/grpc.md, "The fingerprint"), in which any
// two encodings of one request are one. The error is always nil.
func HashRequest(fullMethod string, req proto.Message) (store.Fingerprint, error) {
	return protohash.Hash(fullMethod, req, nil), nil
}
