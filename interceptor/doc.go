// Package interceptor is idemkey's gRPC server and client interceptors.
//
// The client interceptor attaches one idempotency key to each call; the
// server interceptor runs a call at most once per key and answers every retry
// with the first call's recorded reply.
//
//	eng, err := engine.New(st, // the settings every entry point shares
//		engine.WithTenant(tenantOf),
//		engine.WithKeyRequired())
//	if err != nil {
//		return err // a mistake in the options, named with its fix
//	}
//	idem, err := interceptor.UnaryServerInterceptor(eng)
//	if err != nil {
//		return err // such as a misnamed method, or atomic mode on a store without transactions
//	}
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		auth, // puts the caller's identity in the context
//		idem,
//	))
//
//	keys, err := interceptor.UnaryClientInterceptor()
//	...
//	conn, err := grpc.NewClient(addr,
//		grpc.WithTransportCredentials(creds),
//		grpc.WithDefaultServiceConfig(serviceConfig), // retries ABORTED and UNAVAILABLE
//		grpc.WithUnaryInterceptor(keys))
//
// The server takes Options; MethodOptions (which methods are covered, where a
// request carries its key) serve both, and are all the client takes. Like
// every idemkey entry point, each constructor returns a mistake in its
// options as an error and never panics.
//
// # Which calls are covered
//
// Every unary method whose proto does not declare idempotency_level
// NO_SIDE_EFFECTS or IDEMPOTENT, except those of gRPC's own services (package
// grpc.*, such as health checks). WithIncludedMethods and WithExcludedMethods
// override that per method; a name they give that the protobuf registry
// (which generated code fills) does not know is an error when the
// interceptor is built, as is a WithAtomicMethods name that is not covered. A
// replay builds its response message from the method's descriptor, so a
// method whose response type is missing from the registry is not covered,
// and if included by name its calls with a key fail with Internal rather than
// run unprotected. Streaming RPCs are not intercepted:
// there is no stream interceptor, and they pass through untouched.
//
// # The request path
//
// For a covered call the server interceptor:
//  1. reads the key from the idempotency-key metadata: exactly one value,
//     read by idemkey.ParseKey as every entry point reads it (bare, or an
//     RFC 8941 string in double quotes: "k" and k name one key), of 1 to
//     255 bytes of visible ASCII, else InvalidArgument. A call without a
//     key runs unprotected, or is refused if WithKeyRequired; the refusal
//     of one that came through grpc-gateway (its metadata holds the
//     grpcgateway- keys of the HTTP request's standard headers) names
//     idemgateway.ServeMuxOptions, without which the gateway forwards no
//     Idempotency-Key header. The client interceptor sends a key bare, as
//     gRPC clients do, or quoted if idemkey.ParseKey would read it
//     otherwise, so that it reads back as it;
//  2. scopes the key to the tenant (WithTenant) and method (WithScope), and
//     fingerprints the request (Fingerprint, or WithFingerprint);
//  3. reserves the key in the store before running anything. A recorded key
//     replays its outcome, with the trailer idempotent-replayed: true; a key in
//     progress is waited for at the server, for at most WithInProgressWait
//     (2s) and the call's deadline, and answered with the first call's reply
//     as soon as it is recorded; past the wait it answers Aborted with a
//     RetryInfo and the grpc-retry-pushback-ms trailer, and no header, so that
//     a gRPC retry policy retries it; a key first used with a different
//     request answers InvalidArgument at once. A store with bounds that has
//     no room for a new key answers ResourceExhausted (reason
//     IDEMPOTENCY_STORE_FULL), and the handler does not run. A call
//     that gRPC's retry policy marks as a later attempt (AttemptsMetadata)
//     is often a replay, so on a store that implements store.Finder the
//     interceptor first reads its record, and reserves only if no completed
//     one is found (a failed read is answered as a failed reservation): on
//     PostgreSQL the replay then costs a plain SELECT, and no transaction in
//     atomic mode, while a retry that finds nothing (its first attempt still
//     running, or lost before the server) pays the read on top;
//  4. runs the handler, keeping the header and trailer metadata listed by
//     WithReplayedMetadata;
//  5. records the outcome, or releases the key so that a retry runs again;
//  6. returns the handler's own result.
//
// # Expiry and first-sent time
//
// Every answer about a recorded key tells the caller until when the key is
// honoured, as idemkey.ExpiresMetadata (idempotency-key-expires, an HTTP
// date): the first reply, its replays, and the in-progress and reused
// answers. It is a trailer, as idempotent-replayed is, even on a reply: a
// header would stop gRPC's retry policy from retrying an error that an
// interceptor outside idemkey puts in the reply's place. A released key, a
// failed store, no key or a malformed one tell none. On the client,
// KeyExpiry(&t) sets t from it; from a trailer of your own,
// idemkey.ParseExpires(trailer.Get(idemkey.ExpiresMetadata)) reads it.
// The trailers that tell one second's expiry are made once and set on
// every call that tells it, as gRPC's own transport copies what it is set:
// a grpc.ServerTransportStream of your own, outside the interceptor, must
// copy the metadata it is given too, never keep and modify it.
//
// The client interceptor also sends, with the key, when the key's operation
// was first sent (idemkey.FirstSentMetadata, idempotency-first-sent, an
// HTTP date): now, once per call, so every attempt of gRPC's retry policy
// carries the same; or the time UseKeyFirstSent or idemkey.ContextWithKeyFirstSent
// give, for a retry that a loop of your own, or a restarted process, makes
// of an operation it stored. A value already in the metadata is checked,
// and a malformed one fails the call before it is sent. The server refuses
// a call first sent longer ago than keys are kept (WithRetention, less
// WithClockSkew) whose key has no record, with FailedPrecondition
// (IDEMPOTENCY_KEY_EXPIRED) and without running the handler: its first
// call may have run, and its record expired. A first-sent time that is
// malformed, sent twice or later than the clock skew from now is refused
// with InvalidArgument (IDEMPOTENCY_FIRST_SENT_INVALID). A call without one
// is served as before.
//
// # The key in the request (AIP-155)
//
// Google's APIs carry the key in the request as request_id (AIP-155).
// WithKeyField("request_id") takes it from there; WithAnnotatedKeyField
// takes it from a request_id annotated (google.api.field_info).format =
// UUID4. Without either, the request is not read for a key.
// Either the field or the metadata may carry the key; a call with both
// must carry the same key in each, or it is refused (InvalidArgument,
// IDEMPOTENCY_KEY_INVALID). The field is left out of the fingerprint, so a
// request fingerprints alike whichever way its key came.
//
// # Fingerprint
//
// A key first used for one request and then for another is refused
// (InvalidArgument, IDEMPOTENCY_KEY_REUSED); WithFingerprint chooses what
// makes two requests the same. The default, protokey.HashRequest, is a SHA-256 of the
// full method and the request's canonical encoding: its wire encoding with
// every field, known or unknown, in ascending order of number; known fields as
// protobuf-go's deterministic marshalling writes them (proto3 defaults left
// out, varints minimal, repeated scalars packed as the descriptor says, map
// entries by key, sub-messages canonical); unknown fields with minimal tags,
// varints and lengths, their values otherwise as they came. So:
//   - two encodings of one request fingerprint the same, whatever their field
//     order, packing, varint padding or map order;
//   - a server that reads a newer field as unknown fingerprints a request as
//     a server that knows it if the client wrote the field canonically, as
//     protobuf's encoders write scalars, strings, packed lists and most
//     messages (see protokey.HashRequest), so a retry may cross a rolling deploy that
//     adds a field;
//   - a change in any field the server reads, or in an unknown field's value,
//     changes the fingerprint;
//   - a request without unknown fields, extensions, or a oneof field set
//     numbered below another field set, fingerprints as in releases that
//     hashed its deterministic marshalling, whose records it still matches.
//
// # What is recorded
//
// A success is recorded whole: the marshalled response and the allow-listed
// metadata. An error is recorded whole (code, message and details) when its
// code is final: NotFound, AlreadyExists, FailedPrecondition, OutOfRange,
// Unimplemented, Internal, Unknown or DataLoss. Any other code releases the
// key (InvalidArgument, Unauthenticated, PermissionDenied, Canceled,
// DeadlineExceeded, ResourceExhausted, Aborted, Unavailable): the operation did
// not happen, or may succeed when retried. WithRecordedCodes changes the set.
// A handler that panics releases the key, then the panic goes on.
//
// A reply that cannot be recorded, because gRPC could not marshal it either
// or because its record would exceed WithMaxRecordSize (4 MiB by default), is
// answered and recorded as Internal instead, for the first caller and every
// retry alike.
//
// # Sealed and redacted records
//
// WithSealer seals every record at rest (package seal: AES-256-GCM bound to
// the record's key, a key ring that rotates); a record that does not open
// answers Unavailable (IDEMPOTENCY_STORE_UNAVAILABLE), is logged at Error,
// and runs nothing again. WithRedaction removes what must not be recorded
// (response fields, an error's words, metadata) before it reaches the
// store: the first caller gets the whole reply, and every retry the
// redacted one.
//
// So a handler must return a released code only when the call had no effect:
// one that writes and then returns ctx.Err() (Canceled or DeadlineExceeded)
// runs again on the retry. A recovery interceptor belongs outside idemkey; one
// inside it turns a panic into a recorded Internal.
//
// # Two modes
//
// In the default two-phase mode, the reservation commits before the handler
// runs, and the record after it: the right mode for a handler that calls other
// systems, and the only one a store without transactions (store/memory)
// offers. A crash between the handler's effect and the record leaves the key in
// progress until its lease ends; then one retry runs the handler again.
//
// WithAtomic (or WithAtomicMethods) runs methods in atomic mode, on a store
// that implements store.Atomic (store/postgres): the reservation, the
// handler's own writes, through the transaction in its context
// (postgres.TxFromContext), and the record commit in one transaction. Use it
// when all of a handler's effects are writes to the store's database. A crash
// then rolls everything back, so the effects happen exactly once and no key
// is left in progress. The caller gets the handler's reply only once it has
// committed; a failed commit answers Unavailable, and the retry finds the
// truth. A duplicate is told at once that the first call holds the key,
// and waits as in two-phase mode, asking the store again without holding
// anything a new key needs; if the first commits in time, the duplicate gets
// the replay, otherwise Aborted. Until the first call has committed, its fingerprint
// cannot be read, so a duplicate with a different request also gets Aborted,
// where two-phase mode answers InvalidArgument (reused) at once. WithAtomic
// lists the details.
//
// Run one method in one mode on every replica. A method moved between modes
// during a rolling deploy stays at most once: a two-phase reservation of a
// key that an atomic call holds makes that call's commit fail, and it
// answers the two-phase call's record instead.
//
// # One request path for every entry point
//
// The interceptor translates gRPC into the request path of package engine
// and back: the key from the metadata, the fingerprint of the protobuf
// request, the outcome as a protobuf record. The Connect interceptor
// (idemconnect) and the net/http middleware (idemhttp) are the engine's
// other adapters. A Connect procedure has its gRPC method's name and
// fingerprint, and both write one record format, so a key first used over
// one replays over the other on the same store.
//
// # Calls to other services
//
// A handler that calls another idempotent API (a payment provider, another
// gRPC service) should send it DerivedKey(ctx, label): a key derived from the
// call's tenant, method and key, the same on every retry, so the downstream
// call is deduplicated too. label tells apart the handler's downstream calls.
//
// # Guarantees
//
//   - The handler runs at most once per key while its lease holds. The lease
//     is the call's remaining deadline plus 5s, at most 10 minutes (WithLease);
//     a call without a deadline holds it for a minute. Every duration idemkey
//     derives saturates: a deadline of any size, even the largest grpc-timeout
//     (99999999H), gives a lease within these bounds. A retry after the lease
//     has ended presumes the first run dead and runs the handler again. Apart
//     from released outcomes, a store failure under WithFailOpen and a key past
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
//   - With WithSealer, the store holds no plaintext of a reply, and a record
//     moved to another key, altered, or sealed with a key the ring lacks is
//     never replayed, nor its handler run again.
//
// # Metrics, traces and logs
//
// The server interceptor measures what it does through the OpenTelemetry API,
// with the global providers unless WithMeterProvider and WithTracerProvider
// give others; without an SDK installed nothing is recorded, and nothing is
// built for it. Call duration is left to otelgrpc's stats handler.
//
//   - idemkey.calls (counter, {call}): covered calls by idemkey.outcome
//     (executed, replayed, in_progress, reused, key_missing, key_invalid,
//     no_key, store_unavailable, store_full, failed_open, refused,
//     key_expired, first_sent_invalid), with
//     rpc.system.name, rpc.service, rpc.method ("package.Service/Method")
//     and rpc.response.status_code (the final code's canonical name, such
//     as INVALID_ARGUMENT), labelled as otelgrpc labels its own.
//   - idemkey.store.duration (histogram, s): each store operation, by
//     idemkey.store.operation (reserve, find, complete, release, begin,
//     commit; store.Janitor adds sweep), with error.type when it failed (a
//     lost lease or a full store is an answer, not a failure).
//   - idemkey.record.size (histogram, By): the size of each recorded outcome.
//   - idemkey.sweep.deleted (counter, {record}): from store.Janitor.
//
// No attribute value holds a key, a tenant, a request field or a key's hash:
// they would leak, and make a series per call. The call's span, otelgrpc's
// if any, gets the attribute idemkey.outcome and an event of the same name
// (idemkey.replayed, ...); idemkey opens no span for the call, and opens one
// per store operation only under a span that is recording. At Debug level
// the logger gets one line per covered call: outcome, method, code, time
// taken and the scope's hash prefix.
//
// # Hooks
//
// WithHooks gives the application what the metrics leave out: one callback
// per call to a covered method, with its method, tenant, key, verdict, gRPC
// code and record size, to count or audit business operations apart from
// their retries. OnExecute runs when the handler ran (Event.Recorded when
// its outcome became the key's record), OnReplay when a retry got the
// record, OnRefuse when the call was answered without either: in progress,
// reused, missing or malformed key, store full or unavailable, a refused
// tenant. A key sent n times runs OnExecute once and OnReplay n-1 times.
// Hooks run on the call's goroutine once its record is written and before
// the interceptor returns the answer, so a slow hook slows its caller and
// nothing else: it holds no key and no store connection. Their context has
// the call's values but not its cancellation. A panic in a hook is
// recovered and logged at Error (without the key or tenant); the answer
// and the record stand. What a hook does with the raw key and tenant is the
// application's choice: idemkey logs neither.
//
// # Caveats
//
//   - The default fingerprint hashes an unknown field's string, bytes or
//     message as it came: a retry that crosses a deploy adding a field may be
//     refused as a reused key if the client wrote that field in another way
//     than protobuf's encoders (a map's entries, which they write in any
//     order, a message with fields out of order). And a retry after the
//     upgrade from a release that hashed deterministic marshalling, of a
//     request that has unknown fields, extensions or a oneof field set below
//     another field, is refused as reused.
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
//   - After its retention (WithRetention, 24 hours by default) a key is new
//     again, as in Stripe's API, unless its call tells when it was first sent
//     (see Expiry and first-sent time). Keep a business-level unique
//     constraint as the second line of defence.
package interceptor
