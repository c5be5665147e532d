package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store"
)

// KeyStatus is what became of a key, as Lookup tells it.
type KeyStatus uint8

const (
	// KeyUnknown: the key has no record (never used, released, or expired
	// and gone); a retry runs the operation.
	KeyUnknown KeyStatus = iota
	// KeyInProgress: a call holds the key, or (WithRegion) it was first
	// sent to another region whose record has not arrived; a retry is told
	// to wait.
	KeyInProgress
	// KeyCompleted: an outcome is recorded, and a retry of the same request
	// is answered with it.
	KeyCompleted
	// KeyExpired: the key has no record, and was first sent longer ago than
	// the operation's retention, less the clock skew: a retry is refused
	// (Expired), never run.
	KeyExpired
)

var keyStatusNames = [...]string{"unknown", "in_progress", "completed", "expired"}

func (s KeyStatus) String() string {
	if int(s) >= len(keyStatusNames) {
		return "unknown"
	}
	return keyStatusNames[s]
}

// KeyState is a key's state, as Lookup tells it to the client that sent the key.
type KeyState struct {
	State KeyStatus
	// Outcome, for KeyCompleted, is the recorded outcome, opened (WithSealer)
	// as a replay gets it, in the entry point's encoding; do not modify it.
	Outcome []byte
	// RetryAfter, for KeyInProgress, is the wait a retry would be asked:
	// what the lease has left, at most WithMaxRetryAfter; 0 once the lease
	// has ended, when a retry of the same request takes the key over.
	RetryAfter time.Duration
	// Expires is until when the key is honoured, as every answer about it
	// tells; zero without a record, or if the store cannot tell (a running
	// atomic call's).
	Expires time.Time
	// StepsDone names the key's finished steps (Step), in byte order, in any
	// state: a released run's steps are kept for its retry.
	StepsDone []string

	fingerprint store.Fingerprint // the record's, zero if the store cannot tell
	bind        string            // the operation bound into it (ScopeTenant), or ""
}

// MadeFor reports whether the key's record (KeyCompleted, KeyInProgress)
// was made for the request whose fingerprint is fp, as the entry point's
// Exchange.Fingerprint makes it: false means a retry of that request is
// refused as Reused, and must never be answered with Outcome. It is true
// when the store cannot tell (a running atomic call's record) and without
// a record.
func (ks KeyState) MadeFor(fp store.Fingerprint) bool {
	if ks.fingerprint == (store.Fingerprint{}) {
		return true
	}
	if ks.bind != "" {
		fp = bindOperation(ks.bind, fp)
	}
	return fp == ks.fingerprint
}

// Lookup tells what became of key, sent to op, without running or reserving
// anything: for a client that lost its reply, or was told the outcome is
// unknown, and would rather ask than send its request again. The key is
// scoped as op's calls are: the tenant from WithTenant's function, whose
// error is returned as it is, so that a tenant sees only its own keys (an
// OperationSpec.OwnTenant operation's keys, a broker's, cannot be asked).
// firstSent are the values of the transport's first-sent field, as
// Exchange.FirstSent returns them (none: not sent): a key with no record
// first sent longer ago than the retention is KeyExpired, and values that
// a call would refuse (repeated, not an HTTP date, later than the clock
// skew from now) are a *FirstSentError. firstRegion are the values of its
// first-region field (Exchange.FirstRegion), read only by an engine
// WithRegion: a key with no record first sent to another region is
// KeyInProgress, as its call is answered (Fenced), not KeyUnknown, for a
// retry here does not run it; a malformed or repeated one is a
// *FirstSentError.
//
// The store must be a store.Looker; otherwise the error wraps
// errors.ErrUnsupported. A malformed key is an *idemkey.KeyError. A store
// failure, or a record that does not open, wraps store.ErrUnavailable (and
// store.ErrDataLost where the store lost records) and is logged at Error,
// as a call's is.
//
// Under ScopeTenant a key's record is the key's whichever operation made
// it, and Lookup tells it for any op.
func (e *Engine) Lookup(ctx context.Context, op *Operation, key string, firstSent []string, firstRegion ...string) (KeyState, error) {
	if e.looker == nil {
		return KeyState{}, fmt.Errorf("idemkey: Lookup needs a store that implements store.Looker (store/memory, store/postgres, store/redis); %T does not: %w",
			e.store, errors.ErrUnsupported)
	}
	if err := idemkey.ValidateKey(key); err != nil {
		return KeyState{}, err
	}
	sent, err := e.firstSent(firstSent)
	if err != nil {
		return KeyState{}, err
	}
	var region string
	if e.opts.region != "" {
		if region, err = firstRegionOf(firstRegion); err != nil {
			return KeyState{}, err
		}
	}
	if op.ownTenant {
		return KeyState{}, fmt.Errorf("idemkey: operation %q: its calls tell their own tenant (OperationSpec.OwnTenant), which Lookup cannot: %w",
			op.name, errors.ErrUnsupported)
	}
	c := e.newCall(op)
	tenant, err := c.tenantOf(ctx, nil)
	if err != nil {
		return KeyState{}, err
	}
	c.identify(request{Tenant: tenant, Key: key})
	if !c.checkFirstSent(sent) {
		return KeyState{}, &FirstSentError{"it lies in the future, beyond the clock skew allowed"}
	}
	res, steps, found, err := e.lookup(ctx, c.partition, c.key)
	if err != nil {
		if ctx.Err() == nil {
			c.log(ctx, slog.LevelError, "lookup failed", err)
		}
		if !errors.Is(err, store.ErrUnavailable) && !errors.Is(err, store.ErrDataLost) {
			err = fmt.Errorf("%w: %w", store.ErrUnavailable, err)
		}
		return KeyState{}, fmt.Errorf("idemkey: lookup: %w", err)
	}
	ks := KeyState{StepsDone: steps, fingerprint: res.Fingerprint}
	if e.scopeOperation(op) == "" {
		ks.bind = op.name // as identify binds the fingerprints it reserves with
	}
	switch {
	case !found && c.stale:
		ks.State = KeyExpired
	case !found && e.fenced(request{FirstRegion: region}):
		ks.State, ks.RetryAfter = KeyInProgress, e.opts.retryAfter // as fence answers it
	case !found:
		ks.State = KeyUnknown
	case res.State == store.Completed:
		ks.State, ks.Outcome, ks.Expires = KeyCompleted, res.Outcome, res.Expires
	default:
		ks.State, ks.Expires = KeyInProgress, res.Expires
		ks.RetryAfter = min(max(res.RetryAfter, 0), c.maxRetryAfter())
	}
	return ks, nil
}
