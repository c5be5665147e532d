package consumer

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// This package's errors in a Result, checked with errors.Is.
var (
	ErrNoID         = errors.New("idemkey/consumer: the message has no id")
	ErrInvalidID    = errors.New("idemkey/consumer: the message id is longer than 255 bytes")
	ErrReusedID     = errors.New("idemkey/consumer: the message id was first used with another body")
	ErrFailedBefore = errors.New("idemkey/consumer: the message failed when first processed")
	ErrExpired      = errors.New("idemkey/consumer: the message was sent longer ago than its id's record is kept, and the id has no record")
	// ErrLastDelivery wraps the reason a message would have been redelivered
	// on its last delivery (Delivery.Last): it is dead-lettered instead.
	ErrLastDelivery = errors.New("idemkey/consumer: the message's last delivery did not process it")
	// ErrPanicked is the error of a handler that panicked, with the panic
	// value's type: a transient failure, its id released.
	ErrPanicked = errors.New("idemkey/consumer: the handler panicked")
)

// Final marks err as a final failure: the message is recorded as failed,
// acknowledged and dead-lettered, and never runs again.
func Final(err error) error {
	if err == nil {
		return nil
	}
	return finalError{err}
}

type finalError struct{ error }

func (e finalError) Unwrap() error { return e.error }

// IsFinal is the default classification of a handler's error, the one
// every entry point shares (docs/answers.md): final when it is marked with
// Final, or is a gRPC status whose code the gRPC interceptor records
// (NotFound, AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented,
// Internal, Unknown, DataLoss); transient otherwise, a plain error and
// InvalidArgument included. A handler that knows a message can never
// succeed says so with Final.
func IsFinal(err error) bool {
	if errors.As(err, new(finalError)) {
		return true
	}
	s, ok := status.FromError(err)
	if !ok {
		return false
	}
	switch s.Code() {
	case codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.OutOfRange,
		codes.Unimplemented, codes.Internal, codes.Unknown, codes.DataLoss:
		return true
	}
	return false
}

// ownErrors are the errors a Result holds of this package's, and of the
// engine's, whose words hold nothing of a message's: every one a consumer
// answers with but the handler's.
var ownErrors = []error{ErrNoID, ErrInvalidID, ErrReusedID, ErrFailedBefore, ErrExpired, ErrLastDelivery,
	ErrPanicked, errStillBusy, errStoreUnavailable, errUnopened, store.ErrFull, store.ErrDataLost, engine.ErrOutcomeUnknown}

// ownError is err, if it is one of ownErrors or an engine.FirstSentError;
// or else a stand-in that names only a gRPC status's code, or the error's
// type (inside a Final), since a handler's, a hook's or an adapter
// function's words may quote the message's id, tenant or body.
func ownError(err error) error {
	for _, own := range ownErrors {
		if errors.Is(err, own) {
			return own
		}
	}
	if fse := new(engine.FirstSentError); errors.As(err, &fse) {
		return fse
	}
	if s, ok := status.FromError(err); ok && err != nil {
		return errors.New("the handler's gRPC status " + s.Code().String())
	}
	if final := new(finalError); errors.As(err, final) {
		return fmt.Errorf("a final error (consumer.Final) of type %T (its words are left out: they may quote the message)", final.error)
	}
	return fmt.Errorf("an error of type %T (its words are left out: they may quote the message)", err)
}

// Cause says why a Result failed, for a dead letter or a log line that
// others read: the words of this package's errors (ErrLastDelivery's with
// the reason it wraps), a gRPC status's code, or else only the error's type;
// never the handler's own words, which may quote the message.
func Cause(err error) string {
	if err == nil {
		return ""
	}
	prefix := ""
	if errors.Is(err, ErrLastDelivery) {
		prefix = ErrLastDelivery.Error() + ": "
		if multi, ok := err.(interface{ Unwrap() []error }); ok && len(multi.Unwrap()) == 2 {
			err = multi.Unwrap()[1] // fmt.Errorf("%w: %w", ErrLastDelivery, why)
		}
	}
	return prefix + ownError(err).Error()
}
