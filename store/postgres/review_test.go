package postgres

import (
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// A duplicate in the holder's own store whose Begin is on its way as the
// holder's atomic run commits unasked: forget wakes no one yet (the
// duplicate watches only after its Begin), the Begin's reply notes the key
// held afresh and asks, and the store hears its own question. The ring of
// ended runs would answer it, but hear finds the duplicate's own hold
// first and only marks it wanted: nothing ever tells the duplicate, which
// is left to its first poll, unlike one in another store.
func TestReviewOwnStoreDuplicateOfARunEndedUnasked(t *testing.T) {
	var s Store
	s.watch.listening.Store(true)
	key := store.Key{7}
	s.watch.holds(key, time.Minute, s.watch.heard.Load(), acquired) // the holder's Begin
	since := s.watch.heard.Load()                                   // the duplicate's Begin is sent
	if s.watch.end(key) {                                           // the COMMIT goes out, unasked
		t.Fatal("asked")
	}
	s.watch.forget(key) // the COMMIT returned
	ask := s.watch.holds(key, time.Minute, since, heldAsking)
	if !ask {
		t.Fatal("the duplicate does not ask")
	}
	answer := s.watch.hear(askPrefix + hex.EncodeToString(key[:])) // its own question, through Listen
	changed, stop := s.Watch(key)
	defer stop()
	select {
	case <-changed:
	default:
		if answer == "" {
			t.Fatal("the duplicate of a run this store committed unasked is neither told nor answered: left to its first poll")
		}
	}
}

// The ring of ended runs has no run in it, only a key, kept for ever (until
// 64 others end): a run that rolled back unasked leaves its key there, and a
// question about the key's next run, asked long after, held by another store, is answered with a notification of the key
// although nothing changed, for the asker to read in vain (and spend the
// engine's trust in the Watch).
func TestReviewRingAnswersALaterRun(t *testing.T) {
	var s Store
	s.watch.listening.Store(true)
	key := store.Key{8}
	s.watch.holds(key, time.Minute, s.watch.heard.Load(), acquired)
	s.watch.end(key)
	s.watch.forget(key) // rolled back, unasked: the key is free
	// Later than any duplicate of that run could ask (past its lease),
	// another store's run holds the key, and its duplicate asks.
	s.watch.offset = func() time.Duration { return 2 * time.Minute }
	if answer := s.watch.hear(askPrefix + hex.EncodeToString(key[:])); answer != "" {
		t.Fatalf("a question about a run of another store, after this store's rolled back: answered %q, want nothing", answer)
	}
}

// An answered slot of the ring is set to the zero key, which then matches
// a question about the zero key, as any session on the channel can send.
func TestReviewRingZeroKey(t *testing.T) {
	var s Store
	s.watch.listening.Store(true)
	key := store.Key{9}
	s.watch.holds(key, time.Minute, s.watch.heard.Load(), acquired)
	s.watch.end(key)
	s.watch.forget(key)
	s.watch.hear(askPrefix + hex.EncodeToString(key[:])) // answered, slot zeroed
	for i := range 3 {
		if answer := s.watch.hear(askPrefix + strings.Repeat("0", 64)); answer != "" {
			t.Fatalf("question %d about the zero key, which this store never held: answered %q", i, answer)
		}
	}
}
