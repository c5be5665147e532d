// Package interceptor is idemkey's gRPC server and client interceptors.
//
// The client interceptor attaches one idempotency key to each call; the
// server interceptor runs a call at most once per key and answers every retry
// with the first call's recorded reply.
//
//	eng, err := engine.New(st, engine.WithTenant(tenantOf)) // the settings every entry point shares
//	...
//	idem, err := interceptor.UnaryServerInterceptor(eng) // an error: a misnamed method, say
//	...
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, idem)) // auth: the caller's identity in the context
//
//	keys, err := interceptor.UnaryClientInterceptor()
//	...
//	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds),
//		grpc.WithDefaultServiceConfig(serviceConfig), // retries ABORTED and UNAVAILABLE
//		grpc.WithUnaryInterceptor(keys))
//
// Every unary method is covered unless its proto declares idempotency_level
// NO_SIDE_EFFECTS or IDEMPOTENT; a key in progress is answered Aborted with a
// pushback a retry policy retries. docs/grpc.md has the answer tables, the
// request path, the fingerprint, the two modes (WithAtomic) and expiry;
// docs/operations.md the engine's metrics, logs and hooks.
//
// RegisterKeyService serves idemkey.v1.KeyService beside the services, so
// that a client asks what became of a key rather than resend its request
// (docs/answers.md, "A key's state"); WithLookupFirst has the client
// interceptor ask it before it resends a large request.
//
// # Guarantees
//
//   - The handler runs at most once per key while its lease holds (the
//     call's deadline plus 5s, at most 10 minutes). It runs again only after
//     a released code or a panic, after the lease, under engine.WithFailOpen,
//     or past the key's retention; completion is fenced.
//   - A failing store answers Unavailable, the handler not run, unless
//     WithFailOpen.
//   - Errors and logs never hold a raw key, tenant or request.
//
// # Caveats
//
//   - A retry loop of your own must run inside the client interceptor, or
//     reuse one key (UseKey, idemkey.ContextWithKey); both need the client
//     interceptor, without which the call goes out with no key, silently.
//   - Header metadata set before idemkey (grpc.SetHeader) makes the
//     in-progress answer one a retry policy does not retry.
//   - After its retention (24 hours) a key is new again unless its call tells
//     when it was first sent: keep a business-level unique constraint too.
package interceptor
