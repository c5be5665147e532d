// Package idemconnect is idemkey's server and client interceptors for
// connect-go (connectrpc.com/connect): the gRPC interceptor's behaviour, for
// handlers served over Connect's three protocols (Connect, gRPC, gRPC-Web).
//
// The client interceptor attaches one idempotency key to each call; the
// server interceptor runs a call at most once per key and answers every retry
// with the first call's recorded reply. It does not import grpc-go.
//
// # Example
//
//	eng, err := engine.New(st, engine.WithTenant(tenantOf), engine.WithKeyRequired())
//	if err != nil {
//		return err
//	}
//	idem, err := idemconnect.NewServerInterceptor(eng)
//	if err != nil {
//		return err
//	}
//	mux.Handle(paymentsv1connect.NewPaymentServiceHandler(svc,
//		connect.WithInterceptors(auth, idem))) // auth first: it names the tenant
//
//	client := paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, url,
//		connect.WithInterceptors(idemconnect.NewClientInterceptor()))
//
// NewKeyServiceHandler serves idemkey.v1.KeyService, so that a client asks
// what became of a key rather than resend its request (docs/answers.md,
// "A key's state").
//
// # Guarantees
//
// Coverage, answers, recorded codes, atomic mode, sealing and redaction are
// the gRPC interceptor's, with the key in the Idempotency-Key header; in
// progress is Aborted with Retry-After. Keys are shared with the gRPC
// interceptor, given the same WithKeyField: a key first used over one replays
// over the other, whichever codec, marked Idempotent-Replayed: true (a first
// execution false; a key not honoured, Idempotency-Status: ignored).
//
// # Caveats
//
//   - Put the interceptor after authentication and any interceptor that
//     changes the request; give connect.WithRecover before it (outside), or
//     a panic is recorded as Internal rather than released.
//   - A grpc-go client does not retry a Connect server's Aborted by itself,
//     and a Connect client has no retry policy: resend the same
//     *connect.Request after idemkey.RetryDelay, one Request per operation.
//
// docs/http.md, "Connect in full", has the answers, expiry, metrics and
// every caveat.
package idemconnect
