// Package busystore wraps a store so that a test of a message's last
// delivery knows when it finds its message in progress elsewhere: the moment
// to let the run that holds the message end. The broker tests of idemnats and
// idemamqp share it.
package busystore

import (
	"context"
	"sync"

	"github.com/idemkey/idemkey/store"
)

// Store is a store.Store whose Busy channel closes the first time a
// reservation made under LastDelivery's context finds its key in progress.
type Store struct {
	store.Store
	once sync.Once
	busy chan struct{}
}

// New wraps st.
func New(st store.Store) *Store { return &Store{Store: st, busy: make(chan struct{})} }

// Busy is closed once a last delivery has found its key in progress.
func (s *Store) Busy() <-chan struct{} { return s.busy }

type lastDelivery struct{}

// LastDelivery marks ctx as that of a message's last delivery.
func LastDelivery(ctx context.Context) context.Context {
	return context.WithValue(ctx, lastDelivery{}, true)
}

// Reserve is the wrapped store's, closing Busy as Store says.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := s.Store.Reserve(ctx, r)
	if err == nil && res.State == store.Held && ctx.Value(lastDelivery{}) != nil {
		s.once.Do(func() { close(s.busy) })
	}
	return res, err
}
