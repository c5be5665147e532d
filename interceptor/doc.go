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
// The server takes Options; MethodOptions (which methods are covered, where a
// request carries its key) serve both, and are all the client takes. Like
// every idemkey entry point, each constructor returns a mistake in its
// options as an error and never panics.
//
// # What it does
//
// Every unary method is covered unless its proto declares idempotency_level
// NO_SIDE_EFFECTS or IDEMPOTENT, or it belongs to gRPC's own services
// (grpc.*); WithIncludedMethods and WithExcludedMethods override that.
// Streaming RPCs pass through. For a covered call the server interceptor
// reads the key (the idempotency-key metadata, read by idemkey.ParseKey, or a
// request field: WithKeyField, WithAnnotatedKeyField), scopes it to the
// tenant and method, fingerprints the request (protokey.HashRequest, or
// WithFingerprint), and hands the call to the engine, which reserves the key
// before anything runs. A recorded key replays its outcome (trailer
// idempotent-replayed: true); a key in progress is waited for up to
// engine.WithInProgressWait (2s), then answered Aborted with a pushback,
// trailers-only, which a gRPC retry policy retries; a key first used with
// another request answers InvalidArgument. Otherwise the handler runs, and
// its outcome is recorded (OK and the final codes; WithRecordedCodes) or the
// key released (the other codes, and a panic) so that a retry runs again.
//
// Every answer about a recorded key carries its expiry in the trailer
// idempotency-key-expires (KeyExpiry reads it). With the key, the client
// interceptor sends the first-sent time (idempotency-first-sent): a key
// first sent longer ago than the retention, with no record, is refused
// (IDEMPOTENCY_KEY_EXPIRED) and does not run.
//
// WithAtomic or WithAtomicMethods run methods in atomic mode on a store that
// implements store.Atomic (store/postgres): the handler's writes, through
// postgres.TxFromContext, commit with the key's record, so they happen
// once whatever crashes. WithRedaction keeps out of the record what a retry
// need not get. A handler that calls another idempotent API sends it
// idemkey.DerivedKey(ctx, label), a key derived from the call's, the same on
// every retry.
//
// The repository's docs/grpc.md has the tables, coverage, the request path,
// the fingerprint, the two modes, expiry, AIP-155 and grpcurl;
// docs/answers.md every entry point's answers; docs/operations.md the
// metrics, traces, logs and hooks, which are the engine's.
//
// # Guarantees
//
//   - The handler runs at most once per key while its lease holds. The lease
//     is the call's remaining deadline plus 5s, at most 10 minutes (engine.WithLease);
//     a call without a deadline holds it for a minute. Every duration idemkey
//     derives saturates: a deadline of any size, even the largest grpc-timeout
//     (99999999H), gives a lease within these bounds. A retry after the lease
//     has ended presumes the first run dead and runs the handler again. Apart
//     from released outcomes, a store failure under engine.WithFailOpen and a key past
//     its retention, that is the only way a handler runs twice for one key.
//     Completion is fenced, so the first run cannot then overwrite the reply of
//     the second. In atomic mode a run's writes commit only with its record,
//     so they happen once, whatever crashes.
//   - A replay returns the recorded response message: the same bytes on the
//     wire for messages without map fields (maps may be re-encoded in another
//     order, with the same meaning).
//   - A store that fails makes covered calls fail closed with Unavailable, and
//     the handler does not run, unless WithFailOpen.
//   - The store writes after the handler use a context detached from the
//     caller's cancellation, so a client that hangs up does not leave its key
//     in progress; the store bounds their time. A record that still fails
//     (say, the database restarts) is tried again in the background until
//     shortly before the lease ends, and each outcome is logged: only a
//     process that dies meanwhile loses a record whose reply was given.
//   - idemkey's own errors and log records never hold a raw key, tenant or
//     request: stores keep a SHA-256 of the scope, and logs show a prefix of
//     that hash. Errors of a TenantFunc or FingerprintFunc are passed on, or
//     logged, as they are.
//   - Once the handler has run, its key is never released but for a
//     released code or a panic: a reply that cannot be recorded (say, a
//     response gRPC cannot marshal, one too large, or one a redaction
//     function panicked on) is recorded as Internal.
//   - With engine.WithSealer, the store holds no plaintext of a reply, and a record
//     moved to another key, altered, or sealed with a key the ring lacks is
//     never replayed, nor its handler run again.
//
// # Caveats
//
//   - The default fingerprint hashes an unknown field as it came: a retry
//     that crosses a deploy adding a field may be refused as reused if the
//     client wrote that field otherwise than protobuf's encoders do
//     (docs/grpc.md, "The fingerprint").
//   - A retry loop of your own must run inside the client interceptor (a
//     retry interceptor chained after it), or reuse one key through UseKey or
//     idemkey.ContextWithKey: a key made per attempt defeats the scheme. gRPC's
//     service-config retries run below all interceptors and resend the same
//     key.
//   - UseKey and UseKeyFirstSent are read by the client interceptor alone:
//     on a connection without it, gRPC ignores them and the call goes out
//     with no key, silently, and so is idemkey.ContextWithKey. Without the
//     interceptor, put the key in the outgoing metadata yourself
//     (idemkey.KeyMetadata).
//   - The in-progress answer is trailers-only only if nothing before idemkey
//     set header metadata: an interceptor outside it that calls grpc.SetHeader
//     stops gRPC's retry policy from retrying that answer.
//   - After its retention (engine.WithRetention, 24 hours by default) a key is new
//     again, as in Stripe's API, unless its call tells when it was first sent
//     (docs/grpc.md, "Expiry and first-sent time"). Keep a business-level unique
//     constraint as the second line of defence.
package interceptor
