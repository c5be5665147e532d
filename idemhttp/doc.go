// Package idemhttp is idemkey's net/http middleware: it runs each covered
// request at most once per idempotency key and answers every retry with the
// recorded response, following draft-ietf-httpapi-idempotency-key-header-07.
// It is an adapter over the engine (package engine), which holds the
// settings every entry point shares; the middleware's options are only its
// own. It builds neither gRPC nor Connect.
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
// which strict servers require; the middleware reads a bare key too:
//
//	Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"
//
// # What is covered
//
// POST and PATCH requests (WithMethods); other methods pass through, as do
// requests without a key unless one is required. A key is scoped by the
// tenant (engine.WithTenant, from r.Context()) and the operation: by default
// the ServeMux pattern that routed the request, so wrap each handler as you
// register it (DefaultOperation; WithOperation). The fingerprint covers the
// method, operation, path, query, media type and body (DefaultFingerprint).
//
// KeyHandler tells a client what became of a key it sent, without its
// request: mount it at, say, GET /v1/idempotency-keys/{key} (docs/answers.md,
// "A key's state").
//
// # Answers and guarantees
//
// The middleware's own answers are RFC 9457 problem bodies whose type names
// the reason (ProblemReason reads it back; WriteProblem writes one): 400 for
// a missing or malformed key, 409 with Retry-After while the first request
// runs, 412 for a key first sent longer ago than the retention with no
// record, 422 for a key reused with another request, 503 for a failed or
// full store. No answer or log record holds the key, the tenant or request
// data.
//
// A recorded response (status, body, the replay list's header fields) is
// replayed byte for byte with Idempotent-Replayed: true; the first caller
// gets exactly what is recorded, marked false. A key on a request not
// covered, or run by a store failing open, gets Idempotency-Status: ignored. Statuses below 400, and 404, 410, 412, 500
// and 501 are recorded; others, and a panic, release the key. In atomic mode
// (WithAtomic) the handler's writes commit with the record, or not at all.
//
// # Caveats
//
// The request body is read whole (WithMaxBodySize, 1 MiB) and the response
// buffered whole (engine.WithMaxRecordSize, 4 MiB; larger is a recorded 500),
// so keep large and streamed responses off covered routes; Flush and Hijack
// do not work there.
//
// The repository's docs/http.md ("The net/http middleware in full") has the
// table of answers, expiry, hooks, atomic mode and every caveat;
// docs/answers.md every entry point's answers.
package idemhttp
