package engine

import (
	"errors"
	"fmt"
)

// FirstSentError is the Answer.Err of a call answered FirstSentInvalid: the
// call's first-sent time (Exchange.FirstSent) cannot be used. Problem says
// why, without quoting it.
type FirstSentError struct{ Problem string }

func (e *FirstSentError) Error() string { return "idempotency first-sent time refused: " + e.Problem }

// ErrTooLarge is why a result larger than WithMaxRecordSize is not
// recorded: Serve passes it to Exchange.StandIn and Answer.StandIn, and
// records the stand-in in its place.
var ErrTooLarge = errors.New("idemkey: the outcome is too large to record")

// tooLarge is why an outcome of size bytes is ErrTooLarge, for the log.
func tooLarge(size, limit int) error {
	return fmt.Errorf("its record of %d bytes exceeds the limit of %d (WithMaxRecordSize)", size, limit)
}

// errSuperseded is call.record's answer, in atomic mode, when another call
// of the key recorded its outcome first (one that committed just as this
// call began): this call's writes were rolled back, nothing of it was
// recorded, and Verdict now says how to answer instead, as after
// call.start: Replayed with the other call's Outcome, Reused, InProgress or
// StoreUnavailable. batch.commit answers it too, when a key of the batch
// was recorded first: then each call that ran is served again on its own.
var errSuperseded = errors.New("idemkey: another call recorded the key first")

// errBatchFailed is batch.commit's answer when nothing of the batch was
// committed, or it is unknown whether everything was: every call that
// batch.record staged is answered StoreUnavailable, and a retry finds out.
var errBatchFailed = errors.New("idemkey: the batch's commit failed")

// errNoOwnTenant refuses a call of an operation with
// OperationSpec.OwnTenant whose Exchange has no Tenant method.
var errNoOwnTenant = errors.New("idemkey: the operation's calls tell their own tenant (OperationSpec.OwnTenant), but this one's Exchange has no Tenant method")

// errNoTenant is Engine.Operation's refusal of an engine that cannot tell
// its callers apart.
var errNoTenant = errors.New("idemkey: the engine cannot tell callers apart, so every caller would share one key space: " +
	"give engine.WithTenant a function that reads the caller's authenticated identity, or engine.WithSingleTenant() for a service whose callers are one tenant")

// errUnopened marks the error of a record that does not open: it is
// answered as a store failure (StoreUnavailable), but never fails open,
// since the key is known to have run.
var errUnopened = errors.New("idemkey: the recorded outcome does not open, so it is neither replayed nor run again")

// unopened wraps the reason a record of a completed key does not open.
func unopened(err error) error { return fmt.Errorf("%w: %w", errUnopened, err) }
