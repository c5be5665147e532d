package postgres

import (
	"encoding/hex"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// A Reserve on its way while Listen's connection is made again may have
// missed its key's notification in the gap: Watch then tells the
// duplicate at once, so that it reads the key rather than wait. One that
// was sent after the connection listens is held as usual.
func TestWatchOfAReserveAcrossAReconnect(t *testing.T) {
	var s Store
	s.watch.listening.Store(true)
	key := store.Key{1}

	since := s.watch.heard.Load() // the Reserve is sent
	s.watch.subscribed()          // Listen listens again meanwhile
	s.watch.holds(key, time.Minute, since, heldSilent)
	changed, stop := s.Watch(key)
	select {
	case <-changed:
	default:
		t.Fatal("Watch of a key whose Reserve was on its way across a reconnect: not told, want told at once")
	}
	stop()

	s.watch.holds(key, time.Minute, s.watch.heard.Load(), heldSilent) // a Reserve sent since
	changed, stop = s.Watch(key)
	defer stop()
	select {
	case <-changed:
		t.Fatal("Watch of a key held, its Reserve sent after the reconnect: told, want held")
	default:
	}
}

// A duplicate's question can reach the holder's Listen before the holder's
// Begin has noted that it holds the key: the holder still counts the key
// asked about, so that its COMMIT notifies. A question about another key,
// or a change of this one, does not.
func TestQuestionBeforeTheHolderNotesItsKey(t *testing.T) {
	var s Store
	s.watch.listening.Store(true)
	key, other := store.Key{1}, store.Key{2}

	since := s.watch.heard.Load() // the holder's Begin is sent
	s.watch.hear(askPrefix + hex.EncodeToString(key[:]))
	s.watch.hear(askPrefix + hex.EncodeToString(other[:]))
	s.watch.holds(key, time.Minute, since, acquired)
	if !s.watch.wanted(key) {
		t.Fatal("a key asked about while its holder's Begin was on its way: not wanted, want its COMMIT to notify")
	}

	s.watch.forget(key) // the holder commits
	since = s.watch.heard.Load()
	s.watch.hear(hex.EncodeToString(key[:])) // the record's notification, heard as the next run begins
	s.watch.holds(key, time.Minute, since, acquired)
	if s.watch.wanted(key) {
		t.Fatal("a key whose record was notified while its next holder's Begin was on its way: wanted, want no question")
	}
}
