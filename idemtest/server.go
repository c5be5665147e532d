package idemtest

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store/postgres"
)

// okRun is the code of a handler's run that succeeded, as the server half
// notes it; a run whose transaction the Kit rolled back is noted with more.
const okRun = "OK"

// holdMetadata marks the first attempt that Chaos.Cancel cancels, for the
// server half to hold.
const holdMetadata = "idemtest-hold"

// serverHalf is the Kit's part on the server (UnaryServerInterceptor): it
// notes each run of the handler for the key of the call under check, and
// holds the first attempt that Chaos.Cancel cancels.
type serverHalf struct {
	on      atomic.Bool // a server half was made: Cancel marks its first attempt
	mu      sync.Mutex
	c       *call         // the call under check; nil between calls
	key     string        // the key its attempts carry
	reached chan struct{} // closed when the server holds the marked attempt; nil when none is awaited
}

// holdContextKey marks the context of the first attempt that the server
// half holds, for the transport's adapter to mark the attempt.
type holdContextKey struct{}

// holds reports whether the attempt sent with ctx is the one for the
// server half to hold.
func holds(ctx context.Context) bool { return ctx.Value(holdContextKey{}) != nil }

// watch makes c, whose attempts carry key, the call whose runs the server
// half notes; nil after it.
func (s *serverHalf) watch(c *call, key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.c, s.key = c, key
}

// arm returns ctx marked for the server half to hold its attempt, and a
// channel closed once the server holds it; nil if no server half was made.
func (s *serverHalf) arm(ctx context.Context) (context.Context, <-chan struct{}) {
	if !s.on.Load() {
		return ctx, nil
	}
	ch := make(chan struct{})
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reached = ch
	return context.WithValue(ctx, holdContextKey{}, true), ch
}

// disarm ends the wait for the held attempt.
func (s *serverHalf) disarm() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reached = nil
}

// ran notes a handler's run that answered code. An attempt marked to be held
// is held until the Kit has cancelled it, and ran reports whether the server
// must then roll its transaction back (atomic mode). A run outside idemkey's
// call is noted, not held.
func (s *serverHalf) ran(ctx context.Context, key string, held bool, code string) (rollBack bool) {
	_, inCall := idemkey.DerivedKey(ctx, "idemtest")
	s.mu.Lock()
	c := s.c
	if c == nil || key != s.key {
		s.mu.Unlock()
		return false
	}
	if !held || !inCall {
		s.mu.Unlock()
		if held {
			code += " (outside idemkey's call, not held: chain the kit's server interceptor after idemkey's)"
		}
		c.noteRun(code)
		return false
	}
	if s.reached != nil {
		close(s.reached)
		s.reached = nil
	}
	s.mu.Unlock()
	<-ctx.Done() // the Kit always cancels the marked attempt
	_, inTx := postgres.TxFromContext(ctx)
	if inTx {
		c.mu.Lock()
		c.rolledBack = true
		c.mu.Unlock()
		code += ", its transaction rolled back by the kit"
	}
	c.noteRun(code + " (the first attempt, held until cancelled)")
	return inTx
}

// noteRun notes a run of c's handler that answered code.
func (c *call) noteRun(code string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.runs = append(c.runs, code)
}
