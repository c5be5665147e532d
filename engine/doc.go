// Package engine is idemkey's request path, written once, and the settings
// every entry point shares. Build one Engine from the store and hand it to
// every entry point that serves the store's keys (interceptor, idemconnect,
// idemhttp, consumer):
//
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//	grpcIdem, err := interceptor.UnaryServerInterceptor(eng)
//	httpIdem, err := idemhttp.Middleware(eng)
//
// Every shared setting is an Option of New, checked once: the tenant
// (WithTenant, or WithSingleTenant: a shared key space is never the silent
// default), whether a key is required, leases, retention, waits, sealing,
// hooks, metrics, logging, fail-open. Entry points on one engine share its
// keys, bounds and metrics: a key first used over gRPC replays over Connect,
// whose procedures have the same names and records. An HTTP route shares a
// gRPC method's keys only as a gateway to it.
//
// # One call
//
// An entry point implements Exchange (where the key, the first-sent time and
// the fingerprint come from, how the handler runs and its result is encoded,
// how each answer is written) and calls Serve, which decides everything
// else; ServeBatch does the same for a batch, in one round trip of a store
// that implements store.BatchAtomic or store.BatchReserver. The steps are in
// the repository's docs/request-path.md, the answers in docs/answers.md.
//
// # Steps and leases
//
// A handler's effects outside its transaction (a card processor's charge)
// are Steps: each is recorded under the key as it returns, and a later run
// of the key (after a released failure, a crash, a redelivery) gets its
// result without running it. A step an earlier run started and never
// finished is reconciled by the handler's function, or answered
// OutcomeUnknown: it is never run blind. While a two-phase handler runs,
// its lease is renewed on a store.Renewer, so that only a run whose process
// died is taken over. See the repository's docs/steps.md.
//
// # A key's state
//
// Lookup tells a client what became of its key without its request: unknown,
// in progress (with the wait a retry would be asked, and the steps done),
// completed (the outcome a retry would replay, opened), or expired and
// refused; scoped as the calls are, so that a tenant sees only its own keys.
// Entry points serve it: interceptor.RegisterKeyService (gRPC) and
// idemhttp.KeyHandler. The store must be a store.Looker.
//
// # Regions
//
// Where each region has its own store and the stores copy each other's
// records asynchronously, WithRegion names the engine's region and fences
// it: a call whose first region (Exchange.FirstRegion: the
// idempotency-first-region metadata, the Idempotency-First-Region header,
// which the client sends with a saved key) is another region's runs nothing
// here. It replays that region's record once replication has brought it,
// and is answered InProgress (verdict Fenced) until then, so only the first
// region runs a key, at any lag. The fence has no bound: a key whose first
// region is down before its record left it waits for that region. An
// engine without WithRegion reads no first region. See the repository's
// docs/regions.md.
//
// # Guarantees and caveats
//
// Every answer about a key tells until when it is honoured (Answer.Expires:
// the record's creation plus WithRetention, on the store's clock). A call
// first sent (Exchange.FirstSent) longer ago than the retention, whose key
// has no record, is answered Expired and never runs: its record may have
// expired.
//
// With WithSealer, outcomes are sealed on their way to the store and opened
// on their way back; adapters see plaintext, stores opaque bytes. A record
// that does not open is answered StoreUnavailable and never fails open: the
// key is known to have run. An adapter's own outcome encoding must not begin
// with 0x00 'i' 'k', which marks a sealed record.
//
// WithHooks runs one callback per call once its verdict is final, to count
// or audit operations apart from their retries; idemkey logs no value of an
// Event. Metrics, spans and log lines are in docs/operations.md.
package engine
