package postgres

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkey/idemkey/internal/waitset"
	"github.com/idemkey/idemkey/store"
)

// How a duplicate hears that the key it waits for changed (store.Watcher).
//
// While Listen runs, a Reserve that finds a record in progress marks it
// waited (insertSQL), and its Complete or Release notifies the table's
// channel in the same statement (completeSQL); docs/postgres.md,
// "Duplicates of a running call", has the design. Watch reads no storage:
// a key this store's Reserve found held, whose lease has not ended and of
// which no notification has arrived since, is held. A notification that
// arrives while that Reserve is on its way counts too (recent). What no
// notification tells (a lease that ends, a deleted record, an atomic commit
// before the question), the engine's polls find; after Listen's connection
// was down, every watched key is told changed.

// Atomic mode: a running atomic call holds the key's lock and writes no row
// until it commits, so there is nothing for a duplicate to mark. Instead, the
// first duplicate of a run that a store finds held asks its holder: the
// ROLLBACK of its Begin goes out with a notification of the key with
// askPrefix, in one round trip it makes anyway. The store holding the key
// hears it (its own Listen; a question heard while its own Begin was on
// its way counts too), and the COMMIT of the key's record goes out
// with a notification of the key, in the same pipeline; so does its
// ROLLBACK, which frees the key. A duplicate that hears it forgets the run,
// so that it asks the holder of the next one afresh. A commit sent before
// the question is heard notifies nothing, so the holder answers a question
// that comes later itself, with a notification of the key once the COMMIT
// or ROLLBACK has returned: a question heard while it was on its way
// (ending) is answered then, in a statement of its own; one heard later
// by Listen, if the key is among the last heardKept that ended unasked
// (ended). A holder that does not listen answers nothing: the duplicate
// then has its answer at its first poll, 25 ms after it began to wait.

// askPrefix marks a notification that asks the holder of a key to notify
// its record (atomic mode).
const askPrefix = "ask:"

// heardKept is how many of the last keys heard a Reserve can check.
const heardKept = 64

// listenRetry is the longest pause between Listen's attempts to connect.
const listenRetry = time.Second

// watch is what Watch decides from; every field below mu is guarded by it.
type watch struct {
	heard     atomic.Uint64
	listening atomic.Bool // Listen runs: Reserve marks, and Watch tells
	running   atomic.Bool // a Listen has been called and not returned
	live      atomic.Bool // Listen's connection listens: every notification is heard

	mu sync.Mutex
	// held maps the keys this store's Reserve or Begin found held or
	// acquired to what it knows of their run.
	held map[store.Key]hold
	// sweepAt is the size of held at which leases that ended are dropped.
	sweepAt int
	waiting waitset.Set
	// recent[n%heardKept] is the notification heard after n others.
	recent [heardKept]heardKey
	// ended[n%heardKept] is the atomic run that ended unasked after n
	// others, for a question that comes after its end (endedN: how many
	// have).
	ended  [heardKept]endedRun
	endedN uint64
	// offset is added to the clock of Watch's decisions, for the tests'
	// Advance (export_test.go).
	offset func() time.Duration
}

// hold is what a store knows of a run of a key it found held or acquired.
type hold struct {
	end time.Time // the lease's end it was told, on the store's clock
	// asked: this store asked the key's holder to notify its record (an
	// atomic run's, which marks no row: see "Atomic mode" above).
	asked bool
	// wanted: another store asked this one, the holder, to notify it.
	wanted bool
	// mine: this store acquired the key; a notification of it that
	// arrives is of an earlier run's record, and only this store's own
	// Complete, Release, Commit or Rollback forgets it.
	mine bool
	// ending: this store's COMMIT or ROLLBACK of the key is on its way
	// with no notification, since no one had asked; askedEnding: a
	// question was heard meanwhile, to answer once it has returned.
	ending, askedEnding bool
}

// endedRun is an atomic run of this store's that ended unasked: its key,
// and the end of its lease, after which no question can be about it (the
// key's next run may be another store's). answered: its question was
// answered, once.
type endedRun struct {
	key      store.Key
	end      time.Time
	answered bool
}

// heardKey is a notification heard: a key whose record changed, or with
// ask, a key whose holder was asked to notify its record.
type heardKey struct {
	key store.Key
	ask bool
}

// channelSQL is the SQL expression of the notification channel of the
// table, named by its OID, as the advisory locks of atomic mode are
// (tryLock): stores on tables of one name in two schemas, each reached
// through its own search_path, never hear each other.
func channelSQL(table string) string {
	return fmt.Sprintf(`'idemkey:' || '%s'::regclass::oid || ':changed'`, table)
}

// Listen listens on the table's notification channel, on a connection it
// takes out of the pool for good, until ctx ends, and then returns ctx's
// error. While it runs, a duplicate that waits for a running call is
// answered as soon as that call's record commits, on any store on the same
// table that listens too. Run it in a goroutine beside the server, one per
// store:
//
//	go st.Listen(ctx)
//
// A connection that fails is made again, after a pause of up to a second;
// the first failure of an outage is logged at Warn. The channel is named by
// the table's OID, read as Listen connects. It is no use behind a pooler in
// transaction mode. Listen returns an error at once if another Listen of the
// store is running.
func (s *Store) Listen(ctx context.Context) error {
	w := &s.watch
	if !w.running.CompareAndSwap(false, true) {
		return errors.New("idemkey postgres: Listen: the store is listening already")
	}
	defer w.running.Store(false)
	w.listening.Store(true)
	defer func() {
		w.listening.Store(false)
		w.wakeAll() // they read the key once, then poll
	}()
	level := slog.LevelWarn // the first failure of an outage; the rest at Debug
	for wait := retryPause; ctx.Err() == nil; {
		listened, err := s.listen(ctx)
		if ctx.Err() != nil {
			break
		}
		if listened {
			level, wait = slog.LevelWarn, retryPause
		}
		s.opts.logger.LogAttrs(ctx, level, "idemkey postgres: Listen has no connection; until it listens again, a duplicate waiting on a running call is answered by polling",
			slog.Any("error", s.translate(ctx, "listen", err)))
		level = slog.LevelDebug
		if !store.Pause(ctx, wait) {
			break
		}
		wait = min(2*wait, listenRetry)
	}
	return ctx.Err()
}

// listen takes a connection out of the pool for good (pgxpool's Hijack),
// so that it is made as the pool's are (its BeforeConnect and AfterConnect
// too) and the pool opens another in its place, and listens on it until it
// fails or ctx ends; listened reports that it got as far as listening.
func (s *Store) listen(ctx context.Context) (listened bool, err error) {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	conn := pc.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	var channel string
	if err := conn.QueryRow(ctx, `SELECT `+channelSQL(s.table)).Scan(&channel); err != nil {
		return false, err
	}
	if _, err := conn.Exec(ctx, `LISTEN "`+channel+`"`); err != nil {
		return false, err
	}
	s.watch.subscribed()
	defer s.watch.live.Store(false)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, err
		}
		if answer := s.watch.hear(n.Payload); answer != "" {
			if _, err := conn.Exec(ctx, s.notifySQL, answer); err != nil {
				return true, err
			}
		}
	}
}

// Watch implements store.Watcher: while Listen runs, a Complete or Release
// of key by any store on the same table tells it.
func (s *Store) Watch(key store.Key) (changed <-chan struct{}, stop func()) {
	w := &s.watch
	if !w.listening.Load() {
		return nil, func() {} // never fires: the engine polls
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if h, ok := w.held[key]; !ok || !w.now().Before(h.end) {
		return waitset.Closed, func() {}
	}
	return w.waiting.Watch(key, &w.mu)
}

func (w *watch) now() time.Time {
	if w.offset == nil {
		return time.Now()
	}
	return time.Now().Add(w.offset())
}

// found is what a Reserve or Begin found of a key (holds).
type found int

const (
	heldSilent found = iota // held, by a Reserve or the probe, which ask nothing
	heldAsking              // held, by begin in a transaction, which asks the holder if holds says so
	acquired                // acquired: this store holds it
)

// holds notes that a Reserve or Begin, sent when heard was since, found key
// held for lease more, unless a notification of key arrived since then, or
// acquired it, whatever arrived (of an earlier run's record). It reports
// whether a heldAsking caller should ask the key's holder to notify its
// record: the first time for the run. A store that holds the key counts as
// having asked: its Complete or Commit tells its own duplicates.
func (w *watch) holds(key store.Key, lease time.Duration, since uint64, how found) (ask bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	// What was heard since the call was sent: a change makes a key found
	// held count as changed (too many to tell count so too, which costs a
	// read); a question makes a key acquired count as asked about, since a
	// duplicate can ask before this store has noted that it holds the key.
	n := w.heard.Load()
	changed, askedMeanwhile := how != acquired && n-since > heardKept, false
	for i := since; n-since <= heardKept && i < n; i++ {
		if e := w.recent[i%heardKept]; e.key == key {
			changed, askedMeanwhile = changed || !e.ask && how != acquired, askedMeanwhile || e.ask
		}
	}
	if changed && !w.held[key].mine {
		delete(w.held, key)
		return false
	}
	if w.held == nil {
		w.held, w.sweepAt = make(map[store.Key]hold), 1024
	}
	now := w.now()
	h := w.held[key]
	if !now.Before(h.end) {
		h = hold{} // an earlier run's, whose question is spent
	}
	asking := how != heldSilent
	ask, h.end, h.asked = asking && !h.asked, now.Add(lease), h.asked || asking
	h.mine = h.mine || how == acquired
	h.wanted = h.wanted || how == acquired && askedMeanwhile
	w.held[key] = h
	if len(w.held) >= w.sweepAt {
		for k, h := range w.held { // holders that never completed, duplicates that did not wait
			if !now.Before(h.end) {
				delete(w.held, k)
			}
		}
		w.sweepAt = max(2*len(w.held), 1024)
	}
	return ask
}

// end reports whether the COMMIT or ROLLBACK of this store's atomic run
// of key, about to go out, is to notify the key: another store asked.
// If not, a question heard from now on is answered after it (ending).
func (w *watch) end(key store.Key) (notify bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	h, ok := w.held[key]
	if ok && !h.wanted {
		h.ending = true
		w.held[key] = h
	}
	return h.wanted
}

// forget notes that this store completed or released key, and tells the
// key's watchers. Without Listen there are none: Watch answers nil, and
// the end of Listen told them all. It reports whether a question about
// the key was heard while its atomic run ended unasked, for the caller
// to answer (Store.ended).
func (w *watch) forget(key store.Key) (answer bool) {
	if !w.listening.Load() {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	h := w.held[key]
	if h.ending && !h.askedEnding {
		w.ended[w.endedN%heardKept] = endedRun{key: key, end: h.end}
		w.endedN++
	}
	// As a notification heard: a Reserve or Begin of this store on its way
	// (a duplicate of the run, which has no Watch yet) counts its key
	// changed, as it would for another store's record.
	w.heardLocked(heardKey{key, false})
	w.forgetLocked(key)
	return h.askedEnding
}

func (w *watch) forgetLocked(key store.Key) {
	delete(w.held, key)
	w.wakeLocked(key)
}

// ended notes that this store's atomic run of key ended (Commit,
// Rollback), and answers a question about it that was heard meanwhile
// (watch.go), in a goroutine: a duplicate that is not told polls.
func (s *Store) ended(key store.Key) {
	if !s.watch.forget(key) {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.timeout)
		defer cancel()
		_, _ = s.pool.Exec(ctx, s.notifySQL, hex.EncodeToString(key[:]))
	}()
}

func (w *watch) wakeLocked(key store.Key) { w.waiting.Wake(key) }

// hear handles a notification: the key of a record changed, in hex, or
// with askPrefix, a key whose holder is asked to notify its record. It
// returns the key's hex for Listen to notify, if this store's run of it
// ended unasked (answer).
func (w *watch) hear(payload string) (answer string) {
	var key store.Key
	asked := strings.HasPrefix(payload, askPrefix)
	if asked {
		payload = payload[len(askPrefix):]
	}
	if len(payload) != 2*len(key) {
		return "" // not a key: nothing the store's statements send
	}
	if _, err := hex.Decode(key[:], []byte(payload)); err != nil {
		return ""
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.heardLocked(heardKey{key, asked})
	if asked {
		h, ok := w.held[key]
		switch {
		case ok && h.ending:
			h.askedEnding = true
			w.held[key] = h
		case ok:
			h.wanted = true
			w.held[key] = h
		default:
			now := w.now()
			for i := range min(w.endedN, heardKept) {
				if r := &w.ended[i]; r.key == key && !r.answered && now.Before(r.end) {
					r.answered = true
					return payload
				}
			}
		}
		return ""
	}
	if h, ok := w.held[key]; ok && h.mine && w.now().Before(h.end) {
		w.wakeLocked(key) // an earlier run's record: this store's run goes on
		return ""
	}
	w.forgetLocked(key)
	return ""
}

// heardLocked keeps h among the last keys heard, for the Reserves and
// Begins on their way (holds).
func (w *watch) heardLocked(h heardKey) {
	n := w.heard.Load()
	w.recent[n%heardKept] = h
	w.heard.Store(n + 1)
}

// subscribed notes that Listen's connection listens: every watched key is
// told changed, since its notification may have been sent before.
func (w *watch) subscribed() {
	w.live.Store(true)
	w.mu.Lock()
	defer w.mu.Unlock()
	// A Reserve on its way heard nothing of the gap either: counting more
	// notifications than it can check makes it count its key changed, so
	// that its duplicate reads the key at once rather than wait.
	w.heard.Add(heardKept + 1)
	w.waiting.WakeAll()
}

// wakeAll tells every watcher its key changed, so that each reads it.
func (w *watch) wakeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waiting.WakeAll()
}
