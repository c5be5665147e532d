// Package engine is idemkey's request path, written once, and the settings
// every entry point shares. Build one Engine from the store, and hand it to
// every entry point that serves the store's keys: the gRPC interceptor
// (interceptor), the Connect interceptor (idemconnect), the net/http
// middleware (idemhttp) and message consumers (consumer):
//
//	eng, err := engine.New(st, engine.WithTenant(tenantOf))
//	grpcIdem, err := interceptor.UnaryServerInterceptor(eng)
//	httpIdem, err := idemhttp.Middleware(eng)
//
// Every shared setting is an Option of New, defined and checked once: the
// tenant (WithTenant, or WithSingleTenant for a service whose callers are
// one tenant: a shared key space is never the silent default), whether a key
// is required, leases, retention, waits, sealing, hooks, metrics, logging,
// fail-open. New returns an error that names the fix for a setting that
// makes no sense. Entry points sharing one engine share its keys (a key
// first used over gRPC replays over Connect), its bounds and its metrics.
//
// # One call
//
// Each entry point only translates: it implements Exchange (where the key,
// the first-sent time and the fingerprint come from, how the handler runs
// and its result is encoded, how each answer is written) and calls Serve.
// Serve decides everything else, in one place: the key's scope, whether a
// key is required, the first-sent check, the reservation, waiting for a
// duplicate, the lease, fail-open, atomic mode, recording and releasing,
// the short error recorded in place of a result that cannot be, the
// metrics and the hooks. ServeBatch does the same for a batch of calls.
//
// # A key's lifetime
//
// Every answer about a key tells until when it is honoured (Answer.Expires:
// its record's creation plus WithRetention, on the store's clock, the same
// for every call of the key), which adapters send as
// idemkey.ExpiresHeader or idemkey.ExpiresMetadata. A call may say when its
// key's operation was first sent (Exchange.FirstSent): one first sent longer ago than the retention, less
// WithClockSkew, whose key has no record, is answered Expired and never
// runs, since its record may have been there and expired (OASIS Repeatable
// Requests' Repeatability-First-Sent). One first sent in the future, beyond
// the skew, is FirstSentInvalid. A record still there replays as ever.
//
// # Batches
//
// On a store that implements store.BatchAtomic (store/postgres), ServeBatch
// decides the calls of a batch of one atomic operation together, in one
// transaction, runs their handlers in it one after another, records each
// call's outcome, and commits them at once: a message consumer that takes
// its messages in batches dedups a batch in one round trip and commits it
// with one commit. On a store that implements store.BatchReserver
// (store/postgres), ServeBatch reserves the keys of a batch of one
// two-phase operation in one round trip, and each call then runs as Serve
// runs it, while its lease is still long enough (each key has one call's
// lease; a call the handlers before it left too little is served on its
// own after the batch).
//
// # Sharing keys between entry points
//
// A key's record is found by its tenant, the operation's name and the key:
// entry points that give one operation the same name and fingerprint a
// request the same way, and encode outcomes in one format, share its keys,
// on one store. So a key first used over gRPC replays over Connect, whose
// procedures have the same names and whose records are gRPC's. The HTTP
// middleware records HTTP responses: an HTTP route shares a gRPC method's
// keys only as a gateway to it.
//
// # Sealing
//
// With WithSealer the engine seals each outcome on its way to the store
// (Complete, or an atomic call's Commit) and opens it on its way back
// (Reserve, Find, Begin), so adapters and stores never see the other form:
// an adapter encodes and decodes plaintext, a store keeps opaque bytes. A
// completed record that does not open (see package seal) is an error of the
// store call, answered StoreUnavailable and logged at Error, and never
// fails open: the key is known to have run. A record whose fingerprint
// differs from the call's is answered Reused without being opened. An
// outcome encoding of an adapter of your own must not begin with the bytes
// 0x00 'i' 'k' (no protobuf message does), which mark a sealed record.
//
// # Hooks and metrics
//
// WithHooks gives the application one callback per call once its verdict
// is final (OnExecute, OnReplay or OnRefuse, with an Event), to count or
// audit business operations apart from their retries; idemkey logs no value
// of an Event. The engine also counts calls by Verdict (idemkey.calls, with
// MetricsSpec's attributes), times the store's operations, measures
// recorded outcomes, marks the span in the call's context and logs a Debug
// line. The repository's docs/operations.md has both in full.
package engine
