package idemkey

// MaxKeyLen is the longest idempotency key accepted, in bytes.
const MaxKeyLen = 255

// ParseReplayed reports whether values, a reply's ReplayedMetadata trailer or
// ReplayedHeader header (a Connect error's Meta()), mark it replayed from an
// earlier call's record rather than produced by the handler.
func ParseReplayed(values []string) bool { return len(values) == 1 && values[0] == "true" }

// ParseExecuted reports whether values, as ParseReplayed's, mark the reply
// the first execution under its key ("false").
func ParseExecuted(values []string) bool { return len(values) == 1 && values[0] == "false" }

// ParseIgnored reports whether values, a reply's StatusMetadata or
// StatusHeader, say its key was not honoured: the call ran unprotected.
func ParseIgnored(values []string) bool { return len(values) == 1 && values[0] == StatusIgnored }

// Names on the wire. gRPC metadata keys are lower case; HTTP and Connect
// header names are case-insensitive.
const (
	KeyMetadata      = "idempotency-key"     // the key, client to server, over gRPC
	KeyHeader        = "Idempotency-Key"     // draft-ietf-httpapi-idempotency-key-header
	ReplayedMetadata = "idempotent-replayed" // "true" on a replay, "false" on a first execution
	ReplayedHeader   = "Idempotent-Replayed"
	// StatusIgnored on a keyed call that ran unprotected: its operation is
	// not covered, or the store failed open. docs/answers.md has every answer.
	StatusMetadata  = "idempotency-status"
	StatusHeader    = "Idempotency-Status"
	StatusIgnored   = "ignored"
	ExpiresMetadata = "idempotency-key-expires" // until when the key is honoured: an HTTP date (FormatDate)
	ExpiresHeader   = "Idempotency-Key-Expires"
	// When the key's operation was first sent, the same on every retry (as
	// OASIS Repeatable Requests' Repeatability-First-Sent): an HTTP date.
	FirstSentMetadata = "idempotency-first-sent"
	FirstSentHeader   = "Idempotency-First-Sent"
	// The region the key's operation was first sent to, the same on every
	// retry, for a server of several regions (engine.WithRegion): a region
	// name (ValidateRegion).
	FirstRegionMetadata = "idempotency-first-region"
	FirstRegionHeader   = "Idempotency-First-Region"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo on every idemkey
// error, over gRPC and Connect.
const ErrorDomain = "idemkey.dev"

// Reasons name why idemkey, not the handler, answered: the ErrorInfo reason
// over gRPC and Connect (its code beside it), the end of an HTTP problem's
// type (its status beside it), the reason a consumer logs and dead-letters.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"        // InvalidArgument (HTTP 400)
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"        // InvalidArgument (HTTP 400)
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"         // InvalidArgument (HTTP 422)
	ReasonInProgress       = "IDEMPOTENCY_KEY_IN_PROGRESS"    // Aborted (HTTP 409)
	ReasonStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"  // Unavailable (HTTP 503)
	ReasonStoreFull        = "IDEMPOTENCY_STORE_FULL"         // ResourceExhausted (HTTP 503)
	ReasonKeyExpired       = "IDEMPOTENCY_KEY_EXPIRED"        // FailedPrecondition (HTTP 412)
	ReasonFirstSentInvalid = "IDEMPOTENCY_FIRST_SENT_INVALID" // InvalidArgument (HTTP 400): the first-sent time or first region
	ReasonOutcomeUnknown   = "IDEMPOTENCY_OUTCOME_UNKNOWN"    // Unknown (HTTP 500): a step's outcome, engine.Step
)
