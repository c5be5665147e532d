// Package idemhttp is idemkey's net/http middleware: it runs each covered
// request at most once per idempotency key and answers every retry with the
// recorded response, following draft-ietf-httpapi-idempotency-key-header-07.
// It is an adapter over the engine (package engine), which decides the
// rest: scope, reservation, leases, waiting for a duplicate, atomic mode,
// metrics. The engine holds the settings every entry point shares (the
// tenant, whether a key is required, leases, retention, sealing, hooks,
// metrics, logging); the middleware's options are only its own. It builds
// neither gRPC nor Connect.
//
// # Example
//
//	eng, err := engine.New(st, engine.WithTenant(tenantOf), engine.WithKeyRequired())
//	if err != nil {
//		return err
//	}
//	idem, err := idemhttp.Middleware(eng)
//	if err != nil {
//		return err
//	}
//	mux := http.NewServeMux()
//	mux.Handle("POST /v1/charges", idem(createCharge)) // r.Pattern names the operation
//	http.ListenAndServe(addr, authenticate(mux))       // authenticate puts the caller in r.Context()
//
// A client should send the key as an RFC 8941 string (idemkey.FormatKey),
// the form the draft gives the field, which strict servers require; the
// middleware is lenient and reads a bare key too. idemkey.ParseKey reads
// it, as every entry point does, so one value names one key over HTTP,
// Connect and gRPC alike:
//
//	Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// # What is covered
//
// POST and PATCH requests (WithMethods); other methods pass through
// untouched, as do covered requests without a key unless one is required
// (engine.WithKeyRequired). A key is scoped by the tenant, which the
// engine's TenantFunc (engine.WithTenant) reads from r.Context(), and the
// operation: by default the ServeMux pattern that routed the request, so
// wrap each handler as you register it (see DefaultOperation; WithOperation
// names operations otherwise). Middleware refuses an engine that cannot
// tell tenants apart, unless engine.WithSingleTenant says that every caller
// shares one key space. The request's fingerprint covers its method,
// operation, path, query, media type and body (DefaultFingerprint;
// WithFingerprint).
//
// # Answers
//
// The middleware's own answers are RFC 9457 application/problem+json
// bodies whose type names the reason (ProblemReason reads it back): 400 for
// a missing or malformed key, 409 with Retry-After while the first request
// runs, 412 for a key first sent longer ago than the retention with no
// record, 422 for a key reused with another request, 503 for a failed or
// full store. No answer or log record holds the key, the tenant or request
// data. WriteProblem writes such a body for an application's own errors.
// Every answer about a key with a record, or in progress, carries
// Idempotency-Key-Expires (idemkey.ParseExpires reads it); a client may send
// Idempotency-First-Sent, the same on every retry. The table of every
// answer, expiry, hooks and atomic mode are in the repository's
// docs/http.md ("The net/http middleware in full"), and every entry point's
// answers in docs/answers.md.
//
// # Guarantees
//
// A response is recorded with its status, its body and the header fields on
// the replay list (Content-Type, Content-Encoding, Content-Language,
// Location, and those of WithReplayedHeaders; never Set-Cookie), and a retry gets it back byte for
// byte, marked with Idempotent-Replayed: true. The first caller gets
// exactly what is recorded: the handler writes to a buffer, sent once the
// response is recorded, with net/http's defaults applied first (status 200,
// a sniffed Content-Type). With WithRedaction, what is recorded is the
// response as the redaction function left a copy of it (a secret taken out
// of the body, a header field removed): the first caller gets the whole
// response, and every retry the redacted one.
//
// engine.WithSealer seals each record at rest (package seal); a record that
// does not open answers 503 (IDEMPOTENCY_STORE_UNAVAILABLE), is logged at Error,
// and runs nothing again.
//
// Recorded (unless WithRecordedStatuses says otherwise): every status below 400,
// and 404, 410, 412, 500 and 501, the final answers. Released, so that a
// retry runs the handler again: every other status, such as 400, 401, 403,
// 408, 409, 422, 425, 429, 502, 503 and 504. A handler that panics releases
// the key; the panic goes on to net/http.
//
// engine.WithHooks runs once per covered request, before the middleware
// writes its own answer. In atomic mode (WithAtomic; store/postgres) the
// handler's writes through postgres.TxFromContext(r.Context()) commit with
// the record, or not at all.
//
// # Caveats
//
//   - The request body is read whole, up to WithMaxBodySize (1 MiB), before
//     anything is reserved; the handler reads the same bytes again.
//   - The response is buffered whole, up to the engine's bound on a record
//     (engine.WithMaxRecordSize, 4 MiB). A larger one is replaced, for the
//     first caller and every retry, by a recorded 500 (RESPONSE_NOT_RECORDED), as
//     the gRPC adapter records Internal. Keep large and streamed responses
//     off covered routes.
//   - Flush does nothing on a covered request: nothing is sent before the
//     handler returns. Hijacking is not supported there: the ResponseWriter
//     is no http.Hijacker, and http.ResponseController.Hijack fails. 1xx
//     responses (103 Early Hints) are dropped.
//   - Header fields off the replay list reach the first caller only.
//   - The header is read when the handler returns, since nothing is sent
//     before: a field set after WriteHeader or Write, which net/http would
//     drop, reaches the first caller, and, if on the replay list, is
//     recorded and replayed. A request the middleware does not cover (no
//     key, another method, failed open) goes to net/http, which drops it.
//   - A record made by another transport (a gRPC call given the same
//     operation name and fingerprint) is not replayed over HTTP: such a
//     retry gets a 500. The default fingerprint never matches another
//     transport's.
//   - Names from WithOperation must come from a fixed set (patterns, method
//     names), never raw paths.
package idemhttp
