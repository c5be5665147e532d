// Package idemgateway puts idemkey's HTTP face on a grpc-gateway ServeMux in
// front of a gRPC service behind interceptor.UnaryServerInterceptor, so that
// a call through the gateway speaks the IETF Idempotency-Key draft as
// idemhttp does and shares its keys with every other entry point:
//
//	mux := runtime.NewServeMux(idemgateway.ServeMuxOptions()...)
//	err := paymentsv1gw.RegisterPaymentServiceHandlerClient(ctx, mux, paymentsv1.NewPaymentServiceClient(conn))
//
// Without it grpc-gateway forwards neither key header, so every key is
// missing. With it the headers reach the call's metadata as sent (a value
// metadata cannot carry is refused, never dropped), the key's fate
// (Idempotent-Replayed, Idempotency-Status) and expiry come back as headers, and idemkey's refusals are RFC 9457 problems
// at the draft's statuses. A ServeMux holds one header matcher and one error
// handler: give yours through WithHeaderMatcher and WithErrorHandler. The
// repository's docs/http.md ("grpc-gateway") has the details. This module
// alone requires grpc-gateway (tested with v2.34.0).
package idemgateway
