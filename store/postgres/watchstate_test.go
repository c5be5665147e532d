package postgres

import (
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
