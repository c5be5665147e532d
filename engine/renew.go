package engine

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/idemkey/idemkey/store"
)

// renewal keeps a two-phase call's lease while its handler runs
// (store.Renewer), so that only a run whose process stopped renewing it (a
// crash, a partition) is taken over. The first renewal comes when half the
// lease is gone; each extends the lease to half as much again as the
// call's, and the next comes when half a lease is left: about one store
// write per lease period, never one for a call shorter than half its
// lease. It runs until the handler returns, whatever its context says: the
// handler's timeout bounds the handler, and a handler still running holds
// its key. A renewal and its timer are reused from renewals by the calls to
// come, once stopped before the timer fired: a call makes no timer of its
// own.
type renewal struct {
	mu    sync.Mutex
	timer *time.Timer   // runs renew
	r     *running      // whose lease; nil once stopped
	lease time.Duration // each renewal's
	every time.Duration // between renewals
	end   time.Time     // when the lease ends at the earliest
}

// renewals holds stopped renewals, whose timers are not armed.
var renewals = sync.Pool{New: func() any {
	rn := new(renewal)
	rn.timer = time.AfterFunc(time.Hour, rn.renew)
	rn.timer.Stop()
	return rn
}}

// renewFailedPause is the wait before a renewal that failed is tried again.
const renewFailedPause = 100 * time.Millisecond

// startRenewal arms the first renewal of r's lease, lease long and ending
// at end at the earliest.
func (r *running) startRenewal(lease time.Duration, end time.Time) {
	rn := renewals.Get().(*renewal)
	rn.mu.Lock()
	defer rn.mu.Unlock()
	rn.r = r
	rn.lease = min(lease+lease/2, max(r.e.opts.maxLease, lease))
	rn.every = max(rn.lease-lease/2, time.Millisecond)
	rn.end = end
	rn.timer.Reset(max(lease/2, time.Millisecond))
	r.renewal = rn
}

// renew renews the lease, then arms the next renewal.
func (rn *renewal) renew() {
	rn.mu.Lock()
	defer rn.mu.Unlock()
	r := rn.r
	if r == nil { // stopped
		return
	}
	ctx := context.WithoutCancel(r.Context)
	left := time.Until(rn.end)
	wctx, cancel := context.WithTimeout(ctx, max(left, rn.every/2))
	began := time.Now()
	err := r.e.renew(wctx, r.partition, r.key, r.token, rn.lease)
	cancel()
	switch {
	case err == nil:
		rn.end = began.Add(rn.lease)
		rn.timer.Reset(rn.every)
	case errors.Is(err, store.ErrLeaseLost), errors.Is(err, store.ErrDataLost):
		r.log(ctx, slog.LevelWarn, "", "renewing the lease was refused: another run may have taken the key over while this handler runs", err)
	default:
		r.log(ctx, slog.LevelWarn, "", "renewing the lease failed; it is tried again", err)
		rn.timer.Reset(renewFailedPause)
	}
}

// stopRenewal stops renewing, waiting for a renewal under way, and returns
// when the lease ends at the earliest. The renewal goes back to renewals
// only if its timer had not fired: a renew that fired may yet be waiting
// for the lock, and finds it stopped.
func (r *running) stopRenewal() time.Time {
	rn := r.renewal
	rn.mu.Lock()
	end := rn.end
	rn.r = nil
	unfired := rn.timer.Stop()
	rn.mu.Unlock()
	r.renewal = nil
	if unfired {
		renewals.Put(rn)
	}
	return end
}
