package engine

import (
	"errors"
	"fmt"
)

// FirstSentError is the Answer.Err of a call answered FirstSentInvalid: its
// first-sent time, or its first region (WithRegion), is refused. Problem
// says why, without quoting the value.
type FirstSentError struct{ Problem string }

func (e *FirstSentError) Error() string { return "idempotency first-sent time refused: " + e.Problem }

// ErrTooLarge is why a result larger than WithMaxRecordSize is not
// recorded; Serve records Exchange.StandIn in its place.
var ErrTooLarge = errors.New("idemkey: the outcome is too large to record")

func tooLarge(size, limit int) error {
	return fmt.Errorf("its record of %d bytes exceeds the limit of %d (WithMaxRecordSize)", size, limit)
}

// errSuperseded is call.record's answer, in atomic mode, when another call
// recorded the key first: this call's writes were rolled back, and Verdict
// now says how to answer. From batch.commit: each call that ran is served
// again on its own.
var errSuperseded = errors.New("idemkey: another call recorded the key first")

// errBatchFailed is batch.commit's answer when nothing, or perhaps
// everything, was committed: a retry finds out.
var errBatchFailed = errors.New("idemkey: the batch's commit failed")

// errNoOwnTenant refuses a call of an operation with
// OperationSpec.OwnTenant whose Exchange has no Tenant method.
var errNoOwnTenant = errors.New("idemkey: the operation's calls tell their own tenant (OperationSpec.OwnTenant), but this one's Exchange has no Tenant method")

var errNoTenant = errors.New("idemkey: the engine cannot tell callers apart, so every caller would share one key space: " +
	"give engine.WithTenant a function that reads the caller's authenticated identity, or engine.WithSingleTenant() for a service whose callers are one tenant")

// errUnopened marks a record that does not open: answered StoreUnavailable,
// but never failing open, since the key is known to have run.
var errUnopened = errors.New("idemkey: the recorded outcome does not open, so it is neither replayed nor run again")

func unopened(err error) error { return fmt.Errorf("%w: %w", errUnopened, err) }
