package redis

import (
	"context"
	"encoding/hex"
	"errors"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/store"
)

// How a duplicate hears that the key it waits for changed (store.Watcher).
//
// A Reserve that finds a record in progress marks it (the field w), and the
// script of a Complete or Release of a marked record publishes its name on
// <prefix>:changed after the write; a key no duplicate waited for costs no
// message. Watch reads no storage: a key this store's Reserve found held,
// whose lease has not ended and of which no message has arrived since, is
// held. A message that arrives while that Reserve is on its way counts too
// (recent). What no message tells (a lease that ends, a deleted record),
// the engine's polls find. While the subscription is down, Watch tells
// nothing; once subscribed anew, every watched key is told changed, so that
// a change in the gap is read at once.
//
// A cluster broadcasts PUBLISH to every node. Sharded pub/sub would need a
// channel per slot, and go-redis v9.23 resubscribes them in one SSUBSCRIBE,
// which a server refuses across slots (CROSSSLOT): it would take 16,384
// connections, so the store uses the broadcast.

// heardKept is how many of the last keys heard a Reserve can check.
const heardKept = 64

// Waiting for the subscription's connection: listenPing is how long the
// channel may stay quiet before a PING, and a PING unanswered for
// listenDead means the connection is dead. listenRetry is the longest pause
// between dials of a server that refuses them.
const (
	listenPing  = 5 * time.Second
	listenDead  = 3 * listenPing
	listenRetry = time.Second
)

// watch is what Watch decides from; every field below mu is guarded by it.
type watch struct {
	channel string // <prefix>:changed
	heard   atomic.Uint64

	mu sync.Mutex
	// held maps the keys this store's Reserve found held or acquired to the
	// lease's end it was told, on s.now's clock.
	held map[store.Key]time.Time
	// sweepAt is the size of held at which leases that ended are dropped.
	sweepAt int
	waiting map[store.Key]*waiters
	// recent[n%heardKept] is the key of the message heard after n others.
	recent [heardKept]store.Key
	live   bool // subscribed, so every message is heard
	// off is set when the server refused the subscription in New, or by
	// Close: Watch then tells nothing, and the duplicates poll.
	off atomic.Bool

	// psMu guards the subscription the goroutine listens on, which it
	// replaces when the connection goes silent, and stopped, which Close
	// sets; done is closed when the goroutine ends.
	psMu    sync.Mutex
	ps      *goredis.PubSub
	stopped bool
	done    chan struct{}
}

// waiters are the duplicates watching one key: ch is closed once it changes.
type waiters struct {
	ch chan struct{}
	n  int // Watches not yet stopped
}

// closedChan is Watch's answer for a key that is not held.
var closedChan = func() chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}()

// subscribe subscribes to the store's channel within ctx and starts the
// goroutine that hears it, which ends when the client is closed.
func (s *Store) subscribe(ctx context.Context) error {
	w := &s.watch
	w.channel = s.opts.prefix + ":changed"
	w.held = make(map[store.Key]time.Time)
	w.waiting = make(map[store.Key]*waiters)
	w.sweepAt = 1024
	ctx, cancel := s.bound(ctx)
	defer cancel()
	ps := s.client.Subscribe(ctx, w.channel)
	if _, err := ps.ReceiveTimeout(ctx, s.opts.timeout); err != nil { // the subscription's confirmation
		_ = ps.Close()
		if refused := (goredis.Error)(nil); errors.As(err, &refused) && ctx.Err() == nil {
			// The server answered, and refused: an ACL user without the
			// channel (Redis 7's acl-pubsub-default), a proxy without
			// pub/sub. The store works without Watch: duplicates poll.
			w.off.Store(true)
			s.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey redis: the server refused the subscription to the store's channel; a duplicate waiting on a running call is answered by polling, not at once",
				slog.String("channel", w.channel), slog.Any("error", err))
			return nil
		}
		return s.translate(ctx, "subscribe", err)
	}
	w.live = true
	w.ps, w.done = ps, make(chan struct{})
	go s.listen(ps)
	return nil
}

// Close stops the subscription that New started for Watch and returns once
// its goroutine has ended; the store keeps working, by polling. Close a
// store dropped while its client lives on; closing the client ends the
// subscription too. It is safe to call more than once.
func (s *Store) Close() error {
	w := &s.watch
	w.off.Store(true)
	w.psMu.Lock()
	ps, done := w.ps, w.done
	w.ps, w.stopped = nil, true
	w.psMu.Unlock()
	if ps != nil {
		_ = ps.Close() // an error is of a connection already gone
		<-done
	}
	w.wakeAll() // they read the key once, then poll
	return nil
}

func (w *watch) isStopped() bool {
	w.psMu.Lock()
	defer w.psMu.Unlock()
	return w.stopped
}

// swap makes next the subscription the goroutine listens on, unless Close
// came first: then it reports false, and the goroutine ends.
func (w *watch) swap(next *goredis.PubSub) bool {
	w.psMu.Lock()
	defer w.psMu.Unlock()
	if w.stopped {
		return false
	}
	w.ps = next
	return true
}

// Watch implements store.Watcher: a Complete or Release of key by any
// store on the same prefix and server (or cluster) tells it.
func (s *Store) Watch(key store.Key) (changed <-chan struct{}, stop func()) {
	w := &s.watch
	if w.off.Load() {
		return nil, func() {} // never fires: the engine polls
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if end, ok := w.held[key]; !ok || !s.now().Before(end) {
		return closedChan, func() {}
	}
	ws := w.waiting[key]
	if ws == nil {
		ws = &waiters{ch: make(chan struct{})}
		w.waiting[key] = ws
	}
	ws.n++
	return ws.ch, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		if ws.n--; ws.n == 0 && w.waiting[key] == ws {
			delete(w.waiting, key)
		}
	}
}

// now is the clock of the store's decisions, with WithClockOffset's offset.
func (s *Store) now() time.Time {
	if s.opts.offset == nil {
		return time.Now()
	}
	return time.Now().Add(s.opts.offset())
}

// holds notes that a Reserve, sent when heard was since, found key held
// until end, unless a message about key arrived since then.
func (w *watch) holds(key store.Key, end time.Time, since uint64, now time.Time) {
	if w.off.Load() {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.heard.Load()
	changed := n-since > heardKept // too many to tell: count it changed, which costs a read
	for i := since; !changed && i < n; i++ {
		changed = w.recent[i%heardKept] == key
	}
	if changed {
		delete(w.held, key)
		return
	}
	w.held[key] = end
	if len(w.held) >= w.sweepAt {
		for k, end := range w.held { // holders that never completed, duplicates that did not wait
			if !now.Before(end) {
				delete(w.held, k)
			}
		}
		w.sweepAt = max(2*len(w.held), 1024)
	}
}

// forget notes that this store completed or released key, or that it
// heard so, and tells the key's watchers.
func (w *watch) forget(key store.Key) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.forgetLocked(key)
}

func (w *watch) forgetLocked(key store.Key) {
	delete(w.held, key)
	if ws := w.waiting[key]; ws != nil {
		close(ws.ch)
		delete(w.waiting, key)
	}
}

// hear handles a message on the channel: the name of a record changed.
func (w *watch) hear(prefix, payload string) {
	var key store.Key
	if len(payload) != len(prefix)+3+2*len(key) || payload[:len(prefix)] != prefix {
		return // not a record's name: nothing the scripts publish
	}
	if _, err := hex.Decode(key[:], []byte(payload[len(prefix)+2:len(payload)-1])); err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.heard.Load()
	w.recent[n%heardKept] = key
	w.heard.Store(n + 1)
	w.forgetLocked(key)
}

// subscribed notes that the subscription is confirmed: after a drop, every
// watched key is told changed, since its message may have been lost.
func (w *watch) subscribed() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.live {
		return
	}
	w.live = true
	w.wakeAllLocked()
}

// wakeAll tells every watcher its key changed, so that each reads it.
func (w *watch) wakeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.wakeAllLocked()
}

func (w *watch) wakeAllLocked() {
	for key, ws := range w.waiting {
		close(ws.ch)
		delete(w.waiting, key)
	}
}

func (w *watch) dropped() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.live = false
}

// listen hears the store's channel until the client or the store is closed,
// subscribing again whenever the connection drops or goes silent.
func (s *Store) listen(ps *goredis.PubSub) {
	w := &s.watch
	defer close(w.done)
	ctx := context.Background()
	var pinged time.Time // when a PING went unanswered so far; zero if none
	retry := 10 * time.Millisecond
	for {
		msg, err := ps.ReceiveTimeout(ctx, listenPing)
		switch m := msg.(type) {
		case *goredis.Message:
			w.hear(s.opts.prefix, m.Payload)
		case *goredis.Subscription:
			if m.Kind == "subscribe" {
				w.subscribed()
				retry = 10 * time.Millisecond
			}
		case *goredis.Pong:
			pinged = time.Time{}
		}
		var netErr net.Error
		switch {
		case err == nil:
		case errors.Is(err, goredis.ErrClosed): // the client's Close
			w.dropped()
			return
		case errors.As(err, &netErr) && netErr.Timeout():
			if pinged.IsZero() {
				pinged = time.Now()
				_ = ps.Ping(ctx) // an error is the connection's, which the next Receive finds
			} else if time.Since(pinged) >= listenDead {
				w.dropped()
				_ = ps.Close()
				next := s.client.Subscribe(ctx, w.channel)
				if !w.swap(next) {
					_ = next.Close() // Close came first
					return
				}
				ps, pinged = next, time.Time{}
			}
		case w.isStopped():
			return // Close closed ps under a Receive
		default:
			// go-redis dials again and subscribes anew at the next Receive.
			w.dropped()
			pinged = time.Time{}
			time.Sleep(retry)
			retry = min(2*retry, listenRetry)
		}
	}
}
