// Package protokey is what idemkey's gRPC and Connect entry points share
// about protobuf requests, so that one request is one key over either.
//
// Use first HashRequest, the canonical fingerprint: a custom
// FingerprintFunc of interceptor or idemconnect that hashes a subset of a
// request should start from it. RequestIDField and KeyFromField read an
// AIP-155 key field (request_id). The kit the two adapters are built from
// is protokey/rpckit, which a handler needs none of.
package protokey
