// Package waitset keeps the duplicates that wait for keys, for the stores
// that implement store.Watcher: one channel per key, closed once the key
// changes. The store guards a Set with its own mutex, which it holds for
// every call; the stop that Watch returns takes that mutex itself.
package waitset

import (
	"sync"

	"github.com/idemkey/idemkey/store"
)

// Set is the keys duplicates wait for. The zero Set is empty and ready.
type Set struct {
	waiting map[store.Key]*waiters
}

// waiters are the duplicates watching one key: ch is closed once it changes.
type waiters struct {
	ch chan struct{}
	n  int // Watches not yet stopped
}

// Closed is a store's answer to a Watch of a key that is not held: a
// channel closed already, so that the duplicate reads the key at once.
var Closed <-chan struct{} = func() chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}()

// Watch returns the channel of key's duplicates, and stop, which mu (the
// store's mutex, held now) guards, to call once the channel is no longer
// read.
func (s *Set) Watch(key store.Key, mu *sync.Mutex) (changed <-chan struct{}, stop func()) {
	if s.waiting == nil {
		s.waiting = make(map[store.Key]*waiters)
	}
	w := s.waiting[key]
	if w == nil {
		w = &waiters{ch: make(chan struct{})}
		s.waiting[key] = w
	}
	w.n++
	return w.ch, func() {
		mu.Lock()
		defer mu.Unlock()
		if w.n--; w.n == 0 && s.waiting[key] == w {
			delete(s.waiting, key)
		}
	}
}

// Wake tells the duplicates of key that it changed.
func (s *Set) Wake(key store.Key) {
	if w := s.waiting[key]; w != nil {
		close(w.ch)
		delete(s.waiting, key)
	}
}

// WakeAll tells every duplicate that its key changed.
func (s *Set) WakeAll() {
	for key, w := range s.waiting {
		close(w.ch)
		delete(s.waiting, key)
	}
}

// Len is how many keys duplicates wait for.
func (s *Set) Len() int { return len(s.waiting) }
