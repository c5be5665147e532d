package engine

import (
	"context"
	"sync"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Polls of a key in progress: each twice as late as the one before, at most
// awaitMaxPoll apart. awaitMargin of a deadline is left for the answer.
const (
	awaitFirstPoll = 25 * time.Millisecond
	awaitMaxPoll   = 500 * time.Millisecond
	awaitMargin    = 50 * time.Millisecond
)

// await polls for w's key, which res found in progress, until it is
// recorded or released, for at most wait and the call's deadline, and
// returns the first result that is not Held, or the last. On a
// store.Watcher, the store's word that the record changed brings the next
// poll forward. The duplicates of one request share their reads
// (reads.poll), so that a flood of them reads once, not once each.
func (e *Engine) await(ctx context.Context, w waited, wait time.Duration, res store.Entry, poll func(context.Context) (store.Entry, error)) (store.Entry, error) {
	if deadline, ok := ctx.Deadline(); ok {
		wait = min(wait, max(time.Until(deadline), 0)-awaitMargin)
	}
	if wait < awaitFirstPoll {
		return res, nil
	}
	end := time.Now().Add(wait)
	timer := time.NewTimer(e.firstPoll)
	defer timer.Stop()
	// Each poll is made under a Watch taken before it, so that a change
	// during the read is told too. A Watch closed as it is taken says the
	// key was not held then; two reads it brings forward in vain are
	// allowed, and then its word is taken for wrong (a store that cannot
	// tell closes every Watch at once) and the rest polls on schedule.
	var changed <-chan struct{} // nil, which never fires, without a Watcher
	stop := func() {}
	defer func() { stop() }()
	trust := 2      // reads a Watch closed at once may yet bring forward in vain
	atOnce := false // changed was closed as it was taken
	watch := func() {
		if e.watcher != nil && trust > 0 {
			stop()
			changed, stop = e.watcher.Watch(w.key)
			select {
			case <-changed:
				atOnce = true
			default:
				atOnce = false
			}
		}
	}
	watch()
	for interval := e.firstPoll; ; interval = min(2*interval, awaitMaxPoll) {
		toldAtOnce := false
		select {
		case <-ctx.Done():
			return res, nil
		case <-timer.C:
		case <-changed:
			toldAtOnce = atOnce
		}
		watch()
		next, ok, err := e.reads.poll(ctx, w, poll)
		if !ok {
			return res, nil
		}
		if err != nil || next.State != store.Held {
			return next, err
		}
		res = next
		if toldAtOnce {
			trust--
		}
		if trust == 0 {
			stop()
			changed, stop = nil, func() {}
		}
		left := time.Until(end)
		if left <= 0 {
			return res, nil
		}
		timer.Reset(min(2*interval, awaitMaxPoll, left))
	}
}

// waited is what a duplicate waits for. Only duplicates that wait for the
// same share a read: an atomic Held carries the reader's own fingerprint,
// and a record is opened only for the request it records.
type waited struct {
	key         store.Key
	fingerprint store.Fingerprint
	atomic      bool
}

// reads are the polls of waiting duplicates under way; nothing is kept once
// a read is answered.
type reads struct {
	mu    sync.Mutex
	byKey map[waited]*read
}

// read is one poll of a key, shared by every duplicate waiting on it: an
// Outcome is read-only (store.Entry).
type read struct {
	done    chan struct{} // closed once res and err are set
	res     store.Entry
	err     error
	sharers int // duplicates that came to wait on it, besides its reader
	// own: the answer is its reader's alone: it acquired the key, or its
	// reader's context ended during it.
	own bool
}

// poll answers a poll for key with a read of its own, or one another
// duplicate made. A read already under way may have begun before this
// duplicate's Watch, missing a change since: only its completed record is
// taken (an answer at any time after the call began), else the next read's.
// ok is false if ctx ended while it waited.
func (s *reads) poll(ctx context.Context, key waited, poll func(context.Context) (store.Entry, error)) (res store.Entry, ok bool, err error) {
	for predates := true; ; predates = false {
		s.mu.Lock()
		r := s.byKey[key]
		if r == nil {
			r = &read{done: make(chan struct{})}
			s.byKey[key] = r
			s.mu.Unlock()
			s.read(ctx, key, r, poll)
			return r.res, true, r.err
		}
		r.sharers++
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return store.Entry{}, false, nil
		case <-r.done:
		}
		if !r.own && (!predates || r.err == nil && r.res.State == store.Completed) {
			return r.res, true, r.err
		}
	}
}

// read makes r and answers those waiting on it, even if the store panics.
func (s *reads) read(ctx context.Context, key waited, r *read, poll func(context.Context) (store.Entry, error)) {
	defer func() {
		s.mu.Lock()
		delete(s.byKey, key)
		s.mu.Unlock()
		close(r.done)
	}()
	r.own = true // until poll returns
	r.res, r.err = poll(ctx)
	r.own = r.res.State == store.Acquired || ctx.Err() != nil
}
