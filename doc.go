// Package idemkey is the vocabulary shared by idemkey's interceptors and
// stores: the metadata names, the rules for a key, and the gRPC statuses a
// client receives, each with a google.rpc.ErrorInfo in domain idemkey.dev.
//
// idemkey gives gRPC services Stripe-style idempotency keys. A client attaches
// one random key to one business operation and retries it as often as the
// network demands; the server runs the operation at most once and answers
// every retry with the first reply. Package interceptor holds the server and
// client interceptors; package store and its sub-packages hold the records.
//
// # Statuses
//
//	situation                             code               reason (HTTP in the IETF draft)
//	key required but missing              InvalidArgument    IDEMPOTENCY_KEY_MISSING (400)
//	key malformed, or sent twice          InvalidArgument    IDEMPOTENCY_KEY_INVALID (400)
//	same key, different request           InvalidArgument    IDEMPOTENCY_KEY_REUSED (422)
//	same key, first call still running    Aborted            IDEMPOTENCY_KEY_IN_PROGRESS (409)
//	store unreachable or failing          Unavailable        IDEMPOTENCY_STORE_UNAVAILABLE (503)
//	store full (memory store's bounds)    ResourceExhausted  IDEMPOTENCY_STORE_FULL (503)
//
// Reason tells them apart on the client:
//
//	_, err := client.CreateCharge(ctx, req)
//	switch interceptor.Reason(err) {
//	case idemkey.ReasonKeyReused:
//		// a bug: the key was reused for a different charge
//	case idemkey.ReasonInProgress:
//		delay, _ := interceptor.RetryDelay(err) // the server's pushback
//		time.Sleep(delay) // then retry with the same key
//	}
//
// The in-progress status also carries a google.rpc.RetryInfo and the
// grpc-retry-pushback-ms trailer, and a replayed reply carries the trailer
// idempotent-replayed: true (see Replayed).
//
// # Keys
//
// A key is 1 to 255 bytes of visible ASCII (0x21 to 0x7E), sent once as the
// idempotency-key metadata; NewKey makes a version 4 UUID. Errors about a key
// never quote it.
package idemkey
