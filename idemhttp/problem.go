package idemhttp

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkey/idemkey"
)

// Reasons of the middleware's own answers, beside the engine's (idemkey.ReasonKeyMissing
// and the others), each the end of a problem type (see problemTypeBase).
const (
	// ReasonRequestTooLarge: the request body is larger than WithMaxBodySize
	// (413). Nothing was reserved.
	ReasonRequestTooLarge = "REQUEST_TOO_LARGE"
	// ReasonRequestUnreadable: the request body could not be read, or the
	// fingerprint function refused the request (400). Nothing was reserved.
	ReasonRequestUnreadable = "REQUEST_UNREADABLE"
	// ReasonResponseNotRecorded: the handler ran, but its response could not
	// be recorded (too large, not replayable, or no room in the store), so
	// this 500 was recorded in its place, for the caller and every retry.
	ReasonResponseNotRecorded = "RESPONSE_NOT_RECORDED"
)

// problemTypeBase starts each problem type; the reason follows in lower case,
// hyphenated. The host is the gRPC ErrorInfo's domain, so that a reason reads
// the same over either.
const problemTypeBase = "https://idemkey.dev/problems/"

// ProblemContentType is the media type of a problem (RFC 9457).
const ProblemContentType = "application/problem+json"

// problemType returns reason's problem type URI; "about:blank" for "".
func problemType(reason string) string {
	if reason == "" {
		return "about:blank"
	}
	return problemTypeBase + strings.ToLower(strings.ReplaceAll(reason, "_", "-"))
}

// ProblemReason returns the reason whose problem type is typ, or "" if
// typ is not one of idemkey's problem types.
func ProblemReason(typ string) string {
	slug, ok := strings.CutPrefix(typ, problemTypeBase)
	if !ok || slug == "" {
		return ""
	}
	for i := 0; i < len(slug); i++ {
		if c := slug[i]; (c < 'a' || c > 'z') && c != '-' {
			return ""
		}
	}
	return strings.ToUpper(strings.ReplaceAll(slug, "-", "_"))
}

// Problem is an RFC 9457 problem details object, as WriteProblem writes it.
// A client reads the reason with ProblemReason(p.Type).
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
}

var titles = map[string]string{
	idemkey.ReasonKeyMissing:       "Idempotency-Key is missing",
	idemkey.ReasonKeyInvalid:       "Idempotency-Key is malformed",
	idemkey.ReasonKeyReused:        "Idempotency-Key is already used with another request",
	idemkey.ReasonInProgress:       "A request is outstanding for this Idempotency-Key",
	idemkey.ReasonStoreUnavailable: "The idempotency store is unavailable",
	idemkey.ReasonStoreFull:        "The idempotency store is full",
	idemkey.ReasonKeyExpired:       "Idempotency-Key has expired",
	idemkey.ReasonFirstSentInvalid: "Idempotency-First-Sent or Idempotency-First-Region is refused",
	idemkey.ReasonOutcomeUnknown:   "The outcome of an earlier request's step is unknown",
	ReasonRequestTooLarge:          "The request body is too large",
	ReasonRequestUnreadable:        "The request body cannot be read",
	ReasonResponseNotRecorded:      "The response could not be recorded",
}

// WriteProblem answers with an RFC 9457 application/problem+json body whose
// type names reason. A status that is not 4xx or 5xx is written as 500; a
// retryAfter above zero adds Retry-After, in whole seconds rounded up. detail
// goes over the wire: it must not hold the key, the tenant or request data.
func WriteProblem(w http.ResponseWriter, status int, reason, detail string, retryAfter time.Duration) {
	if status < 400 || status > 599 {
		status = http.StatusInternalServerError
	}
	title, ok := titles[reason]
	if !ok {
		title = http.StatusText(status)
	}
	body, _ := json.Marshal(Problem{Type: problemType(reason), Title: title, Status: status, Detail: detail}) // never fails: strings and an int
	h := w.Header()
	h.Set("Content-Type", ProblemContentType)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Del("Content-Encoding")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(retryAfterSeconds(retryAfter), 10))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// retryAfterSeconds is d in whole seconds, rounded up, at least 1.
func retryAfterSeconds(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second != 0 {
		s++
	}
	return max(s, 1)
}
