// Package idemgateway puts idemkey's HTTP face on a grpc-gateway ServeMux
// (github.com/grpc-ecosystem/grpc-gateway/v2), in front of a gRPC service
// behind interceptor.UnaryServerInterceptor, so that a call through the
// gateway speaks the IETF Idempotency-Key draft as idemhttp's middleware
// does, and shares its keys with every other entry point of the service:
//
//   - in: the Idempotency-Key and Idempotency-First-Sent headers go to the
//     call's metadata (idemkey.KeyMetadata, idemkey.FirstSentMetadata) as
//     sent, each of their values, the key bare or as the draft's quoted
//     sf-string, which the interceptor reads as the same key. gRPC
//     metadata carries only the bytes 0x20 to 0x7E, and grpc-gateway drops
//     a value with any other, so that the call would run as if it had no
//     key. Such a value goes without the spaces and tabs around it, which
//     every reader of the headers trims, if that is enough; if not (a tab,
//     a UTF-8 letter or another such byte within), it is refused as
//     malformed, 400 (idemkey.ReasonKeyInvalid, or for a first-sent time
//     idemkey.ReasonFirstSentInvalid), never dropped. So a value names the
//     same key through the gateway as behind idemhttp, or is refused the
//     same way, with the same problem. A header that the application's
//     matcher sends to the same metadata (Grpc-Metadata-Idempotency-Key,
//     with runtime.LegacyHeaderMatcher) is forwarded alike;
//   - out: the replay marker and the key's expiry, trailers to a gRPC
//     client, become the Idempotent-Replayed and Idempotency-Key-Expires
//     headers, on a reply and on an error alike;
//   - errors: idemkey's refusals are answered at the draft's statuses as
//     RFC 9457 problems (idemhttp.WriteProblem), with Retry-After where the
//     interceptor asks the client to wait: a missing, malformed or refused
//     key and a malformed first-sent time 400, a key reused with another
//     request 422, a call in progress 409, an expired key 412, a store that
//     is unavailable or full 503. Every other error goes to the error
//     handler the mux would have used.
//
// Without it, grpc-gateway's defaults forward neither header, so every key
// is missing and no stale retry is refused (the interceptor's refusal of a
// call without a key then names ServeMuxOptions); they return the replay
// marker only as a Grpc-Trailer- trailer to a client that asks for
// trailers; and they answer a reused key 400, an expired one 400 and a
// full store 429.
//
// # Use
//
//	mux := runtime.NewServeMux(idemgateway.ServeMuxOptions()...)
//	err := paymentsv1gw.RegisterPaymentServiceHandlerClient(ctx, mux, paymentsv1.NewPaymentServiceClient(conn))
//
// A ServeMux holds one incoming header matcher and one error handler, so
// an application's own go through this package (WithHeaderMatcher,
// WithErrorHandler) rather than beside it: a later
// runtime.WithIncomingHeaderMatcher or runtime.WithErrorHandler would
// replace idemkey's. Forward-response options and metadata annotators
// (runtime.WithMetadata, which idemkey's headers come in by) compose: add
// the application's after these.
//
// This module is the only one of idemkey's that requires grpc-gateway; it
// was built and tested against grpc-gateway v2.34.0.
package idemgateway
