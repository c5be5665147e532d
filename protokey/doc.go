// Package protokey is what idemkey's gRPC and Connect entry points share
// about protobuf requests, so that one request is one key over either:
// HashRequest, the fingerprint a custom FingerprintFunc should start from,
// and KeyField and KeyFromField, which read an AIP-155 key field.
package protokey
