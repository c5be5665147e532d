package idemkey

// MaxKeyLen is the longest idempotency key accepted, in bytes.
const MaxKeyLen = 255

// ParseReplayed reports whether values, those of a reply's ReplayedMetadata
// trailer or ReplayedHeader header, mark it replayed from the record of an
// earlier call rather than produced by running the handler (a Connect
// error carries it in its Meta()):
//
//	replayed := idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata))    // gRPC
//	replayed := idemkey.ParseReplayed(res.Header().Values(idemkey.ReplayedHeader)) // HTTP, Connect
func ParseReplayed(values []string) bool { return len(values) == 1 && values[0] == "true" }

// Names on the wire. gRPC metadata keys are lower case; HTTP and Connect
// header names are case-insensitive.
const (
	// KeyMetadata carries the idempotency key from client to server over
	// gRPC.
	KeyMetadata = "idempotency-key"
	// KeyHeader carries the idempotency key over HTTP and Connect
	// (draft-ietf-httpapi-idempotency-key-header).
	KeyHeader = "Idempotency-Key"
	// ReplayedMetadata is the gRPC trailer set to "true" on a replayed reply.
	ReplayedMetadata = "idempotent-replayed"
	// ReplayedHeader is the HTTP and Connect header set to "true" on a
	// replayed reply.
	ReplayedHeader = "Idempotent-Replayed"
	// ExpiresMetadata is the gRPC response trailer that tells until when the
	// call's key is honoured: an HTTP date (FormatDate).
	ExpiresMetadata = "idempotency-key-expires"
	// ExpiresHeader is ExpiresMetadata's HTTP and Connect response header.
	ExpiresHeader = "Idempotency-Key-Expires"
	// FirstSentMetadata carries, with the key over gRPC, when the key's
	// operation was first sent: an HTTP date (FormatDate), the same on every
	// retry (as OASIS Repeatable Requests' Repeatability-First-Sent).
	FirstSentMetadata = "idempotency-first-sent"
	// FirstSentHeader is FirstSentMetadata's HTTP and Connect header.
	FirstSentHeader = "Idempotency-First-Sent"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo on every idemkey
// error, over gRPC and Connect.
const ErrorDomain = "idemkey.dev"

// Reasons name why a call was answered by idemkey rather than its handler:
// the google.rpc.ErrorInfo reason of a gRPC or Connect error (with the code
// beside it), the end of an HTTP problem's type (with the HTTP status beside
// it), the reason a message consumer logs and gives its dead-letter hook.
const (
	ReasonKeyMissing       = "IDEMPOTENCY_KEY_MISSING"        // InvalidArgument (HTTP 400)
	ReasonKeyInvalid       = "IDEMPOTENCY_KEY_INVALID"        // InvalidArgument (HTTP 400)
	ReasonKeyReused        = "IDEMPOTENCY_KEY_REUSED"         // InvalidArgument (HTTP 422)
	ReasonInProgress       = "IDEMPOTENCY_KEY_IN_PROGRESS"    // Aborted (HTTP 409)
	ReasonStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"  // Unavailable (HTTP 503)
	ReasonStoreFull        = "IDEMPOTENCY_STORE_FULL"         // ResourceExhausted (HTTP 503)
	ReasonKeyExpired       = "IDEMPOTENCY_KEY_EXPIRED"        // FailedPrecondition (HTTP 412)
	ReasonFirstSentInvalid = "IDEMPOTENCY_FIRST_SENT_INVALID" // InvalidArgument (HTTP 400)
)
