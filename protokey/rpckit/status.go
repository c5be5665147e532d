package rpckit

import (
	"context"
	"errors"
	"time"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
)

// The statuses idemkey answers with in a handler's place, the same over gRPC
// and Connect: each carries a google.rpc.ErrorInfo of domain
// idemkey.ErrorDomain with its reason (codes.go), and those that ask the
// client to wait a google.rpc.RetryInfo. Their messages never quote the key,
// the tenant or the request. Each adapter sends one as its own error type.

// Refusal is the status of a, an answer of idemkey's own: InProgress,
// Reused, KeyMissing (its message ends with advice, which says how the
// transport carries a key), Expired, FirstSentInvalid, OutcomeUnknown, StoreFull, and
// StoreUnavailable, or Canceled or DeadlineExceeded when ctx, the call's, has
// ended. The adapter answers the other verdicts itself (Executed, Replayed,
// and KeyInvalid and Refused, whose a.Err it sends as it is).
func Refusal(ctx context.Context, a engine.Answer, advice string) *idemkeyv1.Status {
	switch a.Verdict {
	case engine.InProgress:
		return Refuse(idemkey.ReasonInProgress, "a call with this idempotency key is in progress; retry after "+a.RetryAfter.String(), a.RetryAfter)
	case engine.Reused:
		return Refuse(idemkey.ReasonKeyReused, "idempotency key already used with a different request")
	case engine.KeyMissing:
		return Refuse(idemkey.ReasonKeyMissing, "idempotency key required: "+advice)
	case engine.Expired:
		return Refuse(idemkey.ReasonKeyExpired, "idempotency key expired: its operation was first sent longer ago than keys are kept, and it has no record; the call was not run")
	case engine.FirstSentInvalid:
		problem := "it cannot be read"
		if fse := (*engine.FirstSentError)(nil); errors.As(a.Err, &fse) {
			problem = fse.Problem
		}
		return Refuse(idemkey.ReasonFirstSentInvalid, "idempotency first-sent time refused: "+problem)
	case engine.OutcomeUnknown:
		return Refuse(idemkey.ReasonOutcomeUnknown, "the outcome of a step that an earlier call with this idempotency key started is unknown; "+
			"the call was not completed, and answers so until the step is reconciled or an operator resolves it")
	case engine.StoreFull:
		return Refuse(idemkey.ReasonStoreFull, "idempotency store full; the call was not run; retry after "+a.RetryAfter.String(), a.RetryAfter)
	}
	switch err := ctx.Err(); {
	case errors.Is(err, context.Canceled):
		return &idemkeyv1.Status{Code: int32(rpccode.Code_CANCELLED), Message: []byte(err.Error())}
	case err != nil:
		return &idemkeyv1.Status{Code: int32(rpccode.Code_DEADLINE_EXCEEDED), Message: []byte(err.Error())}
	}
	return Refuse(idemkey.ReasonStoreUnavailable, "idempotency store unavailable; the call was not run")
}

// codes are the status codes of the reasons.
var codes = map[string]rpccode.Code{
	idemkey.ReasonKeyMissing:       rpccode.Code_INVALID_ARGUMENT,
	idemkey.ReasonKeyInvalid:       rpccode.Code_INVALID_ARGUMENT,
	idemkey.ReasonKeyReused:        rpccode.Code_INVALID_ARGUMENT,
	idemkey.ReasonInProgress:       rpccode.Code_ABORTED,
	idemkey.ReasonStoreUnavailable: rpccode.Code_UNAVAILABLE,
	idemkey.ReasonStoreFull:        rpccode.Code_RESOURCE_EXHAUSTED,
	idemkey.ReasonKeyExpired:       rpccode.Code_FAILED_PRECONDITION,
	idemkey.ReasonFirstSentInvalid: rpccode.Code_INVALID_ARGUMENT,
	idemkey.ReasonOutcomeUnknown:   rpccode.Code_UNKNOWN,
}

// FirstRegionProblem says why a client must not send region as its key's
// first region, or is "": it is not a region name (idemkey.ValidateRegion),
// or it goes without the time the key was first sent (timed false), which
// a server would then be told is now at every attempt, so that the key
// never grew stale in a region that lacks its record. It never quotes
// region.
func FirstRegionProblem(region string, timed bool) string {
	switch err := idemkey.ValidateRegion(region); {
	case err != nil:
		return err.Error()
	case !timed:
		return "it needs the time the key was first sent, which was not given"
	}
	return ""
}

// Refuse is the status of reason, with msg, and a google.rpc.RetryInfo of
// retryAfter if one is given.
func Refuse(reason, msg string, retryAfter ...time.Duration) *idemkeyv1.Status {
	st := &idemkeyv1.Status{Code: int32(codes[reason]), Message: []byte(msg)}
	details := []proto.Message{&errdetails.ErrorInfo{Reason: reason, Domain: idemkey.ErrorDomain}}
	for _, d := range retryAfter {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	}
	for _, d := range details {
		// Only a message that cannot be marshalled fails, and these can.
		if a, err := anypb.New(d); err == nil {
			st.Details = append(st.Details, a)
		}
	}
	return st
}

// InvalidKey is the status of a malformed key: err's problem, if err is an
// *idemkey.KeyError, which never quotes the key.
func InvalidKey(err error) *idemkeyv1.Status {
	problem := "it cannot be read"
	if ke := (*idemkey.KeyError)(nil); errors.As(err, &ke) {
		problem = ke.Problem
	}
	return Refuse(idemkey.ReasonKeyInvalid, "idempotency key malformed: "+problem)
}

// Internal is the Internal status with msg.
func Internal(msg string) *idemkeyv1.Status {
	return &idemkeyv1.Status{Code: int32(rpccode.Code_INTERNAL), Message: []byte(msg)}
}
