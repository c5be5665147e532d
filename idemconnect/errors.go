package idemconnect

import (
	"errors"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/idemkey/idemkey"
)

// Header names beside idemkey.KeyHeader and idemkey.ReplayedHeader.
// http.Header canonicalizes them; gRPC clients see them in lower case.
const (
	// retryAfterHeader tells a client that finds its key in progress how
	// many seconds to wait.
	retryAfterHeader = "Retry-After"
	// pushbackHeader tells gRPC's retry policy how many milliseconds to wait
	// (grpc-retry-pushback-ms).
	pushbackHeader = "Grpc-Retry-Pushback-Ms"
	// attemptsHeader counts the earlier attempts of a call that gRPC's retry
	// policy sends again (grpc-previous-rpc-attempts).
	attemptsHeader = "Grpc-Previous-Rpc-Attempts"
)

// Errors that answer for the handler. Their messages match the gRPC
// interceptor's, and never quote the key, the tenant or the request.

func missingKeyError() *connect.Error {
	return newError(connect.CodeInvalidArgument, idemkey.ReasonKeyMissing,
		"idempotency key required: set the "+idemkey.KeyHeader+" header to one random key per operation")
}

func invalidKeyError(problem string) *connect.Error {
	return newError(connect.CodeInvalidArgument, idemkey.ReasonKeyInvalid, "idempotency key malformed: "+problem)
}

// checkKey is idemkey.ValidateKey as a Connect error.
func checkKey(key string) *connect.Error {
	var ke *idemkey.KeyError
	if errors.As(idemkey.ValidateKey(key), &ke) {
		return invalidKeyError(ke.Problem)
	}
	return nil
}

func reusedKeyError() *connect.Error {
	return newError(connect.CodeInvalidArgument, idemkey.ReasonKeyReused,
		"idempotency key already used with a different request")
}

// inProgressError carries retryAfter three ways: a RetryInfo, Retry-After in
// whole seconds (at least one) for HTTP clients, and the pushback in
// milliseconds for gRPC's retry policy. Connect sends the error's metadata as
// headers with its own protocol, and as trailers with gRPC and gRPC-Web.
func inProgressError(retryAfter time.Duration) *connect.Error {
	err := newError(connect.CodeAborted, idemkey.ReasonInProgress,
		"a call with this idempotency key is in progress; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
	err.Meta()[retryAfterHeader] = []string{strconv.FormatInt(ceilDiv(retryAfter, time.Second, 1), 10)}
	err.Meta()[pushbackHeader] = []string{strconv.FormatInt(ceilDiv(retryAfter, time.Millisecond, 0), 10)}
	return err
}

// ceilDiv is d/unit rounded up, at least least, without overflow.
func ceilDiv(d, unit time.Duration, least int64) int64 {
	n := int64(d / unit)
	if d%unit > 0 {
		n++
	}
	return max(n, least)
}

func storeUnavailableError() *connect.Error {
	return newError(connect.CodeUnavailable, idemkey.ReasonStoreUnavailable,
		"idempotency store unavailable; the call was not run")
}

func storeFullError(retryAfter time.Duration) *connect.Error {
	return newError(connect.CodeResourceExhausted, idemkey.ReasonStoreFull,
		"idempotency store full; the call was not run; retry after "+retryAfter.String(),
		&errdetails.RetryInfo{RetryDelay: durationpb.New(retryAfter)})
}

// firstSentInvalidError is err, an *engine.FirstSentError, which never
// quotes the value, as a Connect error.
func firstSentInvalidError(err error) *connect.Error {
	return newError(connect.CodeInvalidArgument, idemkey.ReasonFirstSentInvalid, err.Error())
}

func keyExpiredError() *connect.Error {
	return newError(connect.CodeFailedPrecondition, idemkey.ReasonKeyExpired,
		"idempotency key expired: its operation was first sent longer ago than keys are kept, and has no record; the call was not run")
}

func newError(code connect.Code, reason, msg string, extra ...proto.Message) *connect.Error {
	err := connect.NewError(code, errors.New(msg))
	for _, m := range append([]proto.Message{&errdetails.ErrorInfo{Reason: reason, Domain: idemkey.ErrorDomain}}, extra...) {
		// Only a message that cannot be marshalled fails, and these can.
		if d, derr := connect.NewErrorDetail(m); derr == nil {
			err.AddDetail(d)
		}
	}
	return err
}

// Reason returns the idemkey reason (idemkey.ReasonKeyMissing and the others)
// carried by err, a Connect error, or "" when err is not an idemkey error.
func Reason(err error) string {
	if info, ok := detail[*errdetails.ErrorInfo](err); ok && info.GetDomain() == idemkey.ErrorDomain {
		return info.GetReason()
	}
	return ""
}

// RetryDelay returns the wait an in-progress or store-full error asks of the
// client, from its google.rpc.RetryInfo.
func RetryDelay(err error) (time.Duration, bool) {
	if ri, ok := detail[*errdetails.RetryInfo](err); ok && ri.GetRetryDelay() != nil {
		return ri.GetRetryDelay().AsDuration(), true
	}
	return 0, false
}

// detail returns the first detail of err of type T.
func detail[T proto.Message](err error) (T, bool) {
	var zero T
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return zero, false
	}
	for _, d := range ce.Details() {
		if v, verr := d.Value(); verr == nil {
			if t, ok := v.(T); ok {
				return t, true
			}
		}
	}
	return zero, false
}
