// Package idemconnect is idemkey's server and client interceptors for
// connect-go (connectrpc.com/connect): the gRPC interceptor's behaviour, for
// handlers served over Connect's three protocols (Connect, gRPC, gRPC-Web).
//
// The client interceptor attaches one idempotency key to each call, as the
// RFC 8941 string that draft-ietf-httpapi-idempotency-key-header-07 makes
// the field, which a strict server reads too; the server interceptor runs a
// call at most once per key, on an engine (package engine: the store, and
// the settings every entry point shares), and answers every retry with the
// first call's recorded reply. It does not import google.golang.org/grpc.
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
// # Which calls are covered
//
// As with the gRPC interceptor: every unary procedure whose method does not
// declare idempotency_level NO_SIDE_EFFECTS or IDEMPOTENT (in the protobuf
// registry, or by connect.WithIdempotency on the handler), except those of
// gRPC's own services (package grpc.*). WithIncludedProcedures and
// WithExcludedProcedures override that by procedure, "/package.Service/Method".
// A procedure whose response type is not in the registry cannot be replayed:
// it is not covered, and if included by name its calls with a key fail with
// Internal. Streaming procedures pass through untouched.
//
// # Guarantees
//
//   - The key is the Idempotency-Key header (gRPC clients send it as the
//     metadata idempotency-key): exactly one value, read by idemkey.ParseKey
//     over each of Connect's protocols as every entry point reads it (bare,
//     or an RFC 8941 string in double quotes: "k" and k name one key), of 1
//     to 255 bytes of visible ASCII, else InvalidArgument with reason
//     IDEMPOTENCY_KEY_INVALID. Without one the call runs unprotected, or is
//     refused (IDEMPOTENCY_KEY_MISSING) if keys are required.
//   - Keys are shared with the gRPC interceptor: the operation is the
//     procedure, which is gRPC's full method name; the fingerprint is
//     protokey.HashRequest of the request message, whichever codec carried it
//     (binary or JSON); and the record is the gRPC interceptor's
//     (idemkey.v1.Outcome). On one store with one tenant, a key first used
//     over gRPC replays over Connect, and the reverse, as long as both
//     interceptors are given the same WithKeyField (which the fingerprint
//     leaves out). connect-go's JSON codec drops unknown fields that the
//     binary codec keeps, so a request with fields the server does not know
//     fingerprints otherwise over JSON.
//   - A replay is the first reply: the same message, whichever codec the
//     retry asks for, or the same error (code, message and details), with the
//     headers of WithReplayedHeaders. A replayed reply carries the header
//     Idempotent-Replayed: true, and over gRPC and gRPC-Web the trailer
//     idempotent-replayed: true too, where grpc-go clients look for it (as
//     they do with the gRPC interceptor). A replayed error carries it in its
//     metadata (connect.Error.Meta on the client): Connect sends that as
//     headers with its own protocol, as trailers with gRPC's. idemkey.ParseReplayed reads
//     it.
//   - Answers of idemkey's own are the gRPC interceptor's codes, with a
//     google.rpc.ErrorInfo of domain idemkey.dev (idemkey.Reason reads it); a key in
//     progress is Aborted with Retry-After and a RetryInfo (idemkey.RetryDelay).
//   - Every answer about a key with a record, or in progress, carries
//     Idempotency-Key-Expires; the client interceptor sends
//     Idempotency-First-Sent, and a key first sent longer ago than the
//     retention with no record is refused (IDEMPOTENCY_KEY_EXPIRED).
//   - The handler's errors are recorded or released by code as with the gRPC
//     interceptor (WithRecordedCodes). An error that is not a
//     *connect.Error is Unknown, as Connect sends it; a context error is
//     Canceled or DeadlineExceeded, and released.
//   - Atomic mode (WithAtomic, WithAtomicProcedures) works as with the gRPC
//     interceptor: the transaction rides in the handler's context.
//   - Sealing (engine.WithSealer) and redaction (WithRedaction) work as with
//     the gRPC interceptor: a record that does not open is Unavailable with
//     IDEMPOTENCY_STORE_UNAVAILABLE and runs nothing again; a redacted reply
//     is what every retry gets, the first caller the whole one. Give both
//     adapters one engine and the same redaction when they share a store.
//   - The engine measures each call with rpc.system.name "connectrpc", so
//     one query covers it and the gRPC interceptor's "grpc". docs/http.md
//     ("Connect in full") has the answers, expiry and metrics in full.
//   - engine.WithHooks calls the application's hooks once per covered call,
//     as the gRPC interceptor does (see its package documentation), before
//     the interceptor returns the answer; engine.Event.Code is the
//     connect.Code.
//
// # Caveats
//
//   - A replayed response is not the handler's own *connect.Response type,
//     which an interceptor cannot name: its Any() is a proto.Message whose
//     reflection is the recorded message's, which every codec marshals as
//     that message. An interceptor outside this one that asserts a concrete
//     message type on a response should use proto.Message instead.
//   - Put the interceptor after the one that authenticates the caller, so
//     engine.WithTenant's TenantFunc can read the identity, and after any
//     that change the request: the fingerprint is of the request it sees. A
//     TenantFunc reads the request's headers with
//     connect.CallInfoForHandlerContext; its error reaches the caller
//     unchanged, so make it a *connect.Error such as CodeUnauthenticated.
//   - A handler that panics releases its key, and the panic goes on, as
//     with the gRPC interceptor. connect.WithRecover is an interceptor too:
//     give it before this one (outside it), or a panic reaches this
//     interceptor as the Internal error WithRecover makes of it, which is
//     recorded and replayed.
//   - connect-go's gRPC protocol never sends a trailers-only response over
//     HTTP/2, and grpc-go's retry policy retries only those: a grpc-go client
//     calling a Connect server does not retry Aborted (in progress) by
//     itself. Its retry of Unavailable transmitted before any header is
//     unaffected. A Connect client has no retry policy: retry in your code,
//     sending the same *connect.Request again, and wait idemkey.RetryDelay.
//   - The client interceptor writes the key and the first-sent time into
//     the request's header, so a *connect.Request reused for another
//     operation carries the first one's: build one Request per operation.
package idemconnect
