package engine

import (
	"context"
	"sync"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Polls of a key in progress: the first after awaitFirstPoll, each next one
// twice as late, at most awaitMaxPoll apart. A duplicate leaves awaitMargin of
// its deadline for its answer to reach the client.
const (
	awaitFirstPoll = 25 * time.Millisecond
	awaitMaxPoll   = 500 * time.Millisecond
	awaitMargin    = 50 * time.Millisecond
)

// await waits for w's key, which res found in progress, to be recorded (or
// released), polling the store with poll, for at most wait and the call's
// deadline. It returns the first result that is not InProgress, or
// the last one when the wait runs out. A wait of d costs at most
// 5 + d/awaitMaxPoll polls on schedule. On a store that implements
// store.Watcher, a poll is also made as soon as the store tells that the
// key's record changed, in place of the one due next (the schedule moves
// on as after it): a duplicate has its answer the moment the first call
// records, at no more polls, or two more where the store's word was
// wrong. The duplicates of one request that one engine holds share their
// polls' reads (reads.poll), so that a flood of them, woken at once, reads
// once rather than queue a read each on the store's connections.
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
	// after the poll is told, whenever it lands: during the read too, so a
	// read that found the key held and was told meanwhile is followed by
	// another at once. A Watch closed as it is taken says the key was not
	// held then (its holder released it, and another may have taken it
	// over since); two reads it brings forward that find the key held still
	// are allowed, and then such a word is taken for wrong (a store that
	// cannot tell closes every Watch at once): the rest of the wait polls
	// on schedule.
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

// waited is what a duplicate waits for: its key's record, of its own
// request (its fingerprint), in its operation's mode. Only duplicates that
// wait for the same share a read: an answer depends on all three (an
// atomic Held carries the reader's own fingerprint, and a record is opened
// only for the request it records).
type waited struct {
	key         store.Key
	fingerprint store.Fingerprint
	atomic      bool
}

// reads are the polls of waiting duplicates under way: a duplicate that
// polls for what another is reading waits for that read's answer rather
// than make its own. Nothing is kept once a read is answered.
type reads struct {
	mu    sync.Mutex
	byKey map[waited]*read
}

// read is one poll of a key, whose answer every duplicate waiting on it
// shares: an Outcome is read-only (store.Entry), so one serves them all.
type read struct {
	done    chan struct{} // closed once res and err are set
	res     store.Entry
	err     error
	sharers int // duplicates that came to wait on it, besides its reader
	// own: the answer is its reader's alone. It acquired the key, which is
	// then held for the others, or its reader's context ended during it.
	own bool
}

// poll answers a poll for key: with a read of its own, made with poll, or
// with one another duplicate made. A read that was under way when this
// one came may have begun before this duplicate's Watch was taken, so a
// change since could be missed: only its completed record is taken (a
// record once completed is an answer at any time after the call began),
// and otherwise the next read, which began after, is. ok is false if ctx
// ended while it waited on another's read.
func (s *reads) poll(ctx context.Context, key waited, poll func(context.Context) (store.Entry, error)) (res store.Entry, ok bool, err error) {
	// A read found at the first pass may predate the Watch; one found at a
	// later pass began after the read this duplicate waited on, so after it.
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

// read makes r, the read of key, and answers those waiting on it, even if
// the store panics.
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
