package postgres

import (
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// A Reserve on its way while Listen's connection is made again may have
// missed its key's notification in the gap: Watch then tells the
// duplicate at once, so that it reads the key rather than wait. One that
// was sent after the connection listens is held as usual.
func TestWatchOfAReserveAcrossAReconnect(t *testing.T) {
	s := listeningStore()
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
	s := listeningStore()
	key, other := store.Key{1}, store.Key{2}

	since := s.watch.heard.Load() // the holder's Begin is sent
	s.watch.hear(askPrefix + hex.EncodeToString(key[:]))
	s.watch.hear(askPrefix + hex.EncodeToString(other[:]))
	s.watch.holds(key, time.Minute, since, acquired)
	if !Wanted(s, key) {
		t.Fatal("a key asked about while its holder's Begin was on its way: not wanted, want its COMMIT to notify")
	}

	s.watch.forget(key) // the holder commits
	since = s.watch.heard.Load()
	s.watch.hear(hex.EncodeToString(key[:])) // the record's notification, heard as the next run begins
	s.watch.holds(key, time.Minute, since, acquired)
	if Wanted(s, key) {
		t.Fatal("a key whose record was notified while its next holder's Begin was on its way: wanted, want no question")
	}
}

// A holder whose atomic run ends unasked answers a question that comes
// after all, once: one heard while its COMMIT is on its way is answered
// once the COMMIT has returned (forget reports it), and one heard after
// the run, by Listen (hear returns the key). A run that was asked in time
// notifies with its COMMIT, and answers nothing later.
func TestLateQuestionAnsweredOnce(t *testing.T) {
	s := listeningStore()
	ask := func(k store.Key) string { return s.watch.hear(askPrefix + hex.EncodeToString(k[:])) }
	during, after, asked := store.Key{1}, store.Key{2}, store.Key{3}
	for _, k := range []store.Key{during, after, asked} {
		s.watch.holds(k, time.Minute, s.watch.heard.Load(), acquired)
	}

	if s.watch.end(during) {
		t.Fatal("end of a run no one asked about: notify, want not")
	}
	if answer := ask(during); answer != "" {
		t.Fatalf("question heard while the COMMIT is on its way: answered %q at once, want after the COMMIT", answer)
	}
	if !s.watch.forget(during) {
		t.Fatal("forget of a run asked about while it ended: no answer, want one")
	}
	if answer := ask(during); answer != "" {
		t.Fatalf("a second question, after the answer: answered %q, want nothing", answer)
	}

	s.watch.end(after)
	if s.watch.forget(after) {
		t.Fatal("forget of a run no one asked about: answer, want none")
	}
	if answer, want := ask(after), hex.EncodeToString(after[:]); answer != want {
		t.Fatalf("question heard after the run: answered %q, want %q", answer, want)
	}
	if answer := ask(after); answer != "" {
		t.Fatalf("the question again: answered %q, want once only", answer)
	}

	ask(asked)
	if !s.watch.end(asked) {
		t.Fatal("end of a run asked about in time: no notification, want its COMMIT to notify")
	}
	if s.watch.forget(asked) || ask(asked) != "" {
		t.Fatal("a run asked about in time: answered again after its COMMIT notified")
	}
}

// A duplicate in the holder's own store whose Begin is on its way as the
// holder's atomic run commits unasked finds the key held; forget woke no
// one (the duplicate watches only after its Begin), but counts as a
// notification heard, so the Begin's reply counts the key changed: the
// duplicate asks nothing and its Watch tells it at once.
func TestOwnDuplicateOfARunEndedUnaskedIsTold(t *testing.T) {
	s := listeningStore()
	key := store.Key{7}
	s.watch.holds(key, time.Minute, s.watch.heard.Load(), acquired) // the holder's Begin
	since := s.watch.heard.Load()                                   // the duplicate's Begin is sent
	if s.watch.end(key) {                                           // the COMMIT goes out, unasked
		t.Fatal("end of a run no one asked about: notify, want not")
	}
	s.watch.forget(key) // the COMMIT returned
	if s.watch.holds(key, time.Minute, since, heldAsking) {
		t.Fatal("the duplicate asks about a run its own store has ended")
	}
	changed, stop := s.Watch(key)
	defer stop()
	select {
	case <-changed:
	default:
		t.Fatal("the duplicate of a run its own store committed unasked: not told, left to its first poll")
	}
}

// A run that ended unasked is answered for only until its lease would
// have ended: a question after that is about a later run of the key,
// perhaps another store's, and is not answered (the asker would read in
// vain).
func TestEndedRunAnsweredOnlyWithinItsLease(t *testing.T) {
	s := listeningStore()
	key := store.Key{8}
	ranUnasked(s, key) // rolled back: the key is free
	// Later than any duplicate of that run could ask (past its lease),
	// another store's run holds the key, and its duplicate asks.
	s.watch.offset = func() time.Duration { return 2 * time.Minute }
	if answer := s.watch.hear(askPrefix + hex.EncodeToString(key[:])); answer != "" {
		t.Fatalf("a question about a run of another store, after this store's rolled back: answered %q, want nothing", answer)
	}
}

// A question about the zero key, which any session on the channel can
// send, is not answered by a run that ended unasked and was answered.
func TestEndedRunAnsweredNoZeroKey(t *testing.T) {
	s := listeningStore()
	key := store.Key{9}
	ranUnasked(s, key)
	s.watch.hear(askPrefix + hex.EncodeToString(key[:])) // answered, slot zeroed
	for i := range 3 {
		if answer := s.watch.hear(askPrefix + strings.Repeat("0", 64)); answer != "" {
			t.Fatalf("question %d about the zero key, which this store never held: answered %q", i, answer)
		}
	}
}

// listeningStore is a store whose Listen runs, as far as its watch knows.
func listeningStore() *Store {
	s := &Store{}
	s.watch.listening.Store(true)
	return s
}

// ranUnasked runs an atomic run of key on s to its end, no one asking.
func ranUnasked(s *Store, key store.Key) {
	s.watch.holds(key, time.Minute, s.watch.heard.Load(), acquired)
	s.watch.end(key)
	s.watch.forget(key)
}
