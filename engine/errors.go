package engine

import (
	"errors"
	"fmt"
)

// FirstSentError is FirstSent's error: the call's first-sent time cannot
// be used. Problem says why, without quoting it.
type FirstSentError struct{ Problem string }

func (e *FirstSentError) Error() string { return "idempotency first-sent time refused: " + e.Problem }

// ErrTooLarge is Record's answer to an outcome larger than WithMaxRecordSize.
// Nothing was written: record a short error in its place.
var ErrTooLarge = errors.New("idemkey: the outcome is too large to record")

// errSuperseded is Record's answer, in atomic mode, when another call of the
// key recorded its outcome first (one that committed just as this call
// began): this call's writes were rolled back, nothing of it was recorded,
// and Verdict now says how to answer instead, as after Start: Replayed with
// the other call's Outcome, Reused, InProgress or StoreUnavailable.
var errSuperseded = errors.New("idemkey: another call recorded the key first")

// errBatchFailed is Commit's answer when nothing of the batch was
// committed, or it is unknown whether everything was: answer "store
// unavailable" for every call that Record ended without an error, and a
// retry finds out.
var errBatchFailed = errors.New("idemkey: the batch's commit failed")

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
