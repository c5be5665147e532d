// Package enginetest serves calls through the engine with no transport in
// front of it, for the tests and benchmarks of what lies under the entry
// points: stores, sealing.
package enginetest

import (
	"context"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// Call is one call with a key, of one request (the fingerprint {1}) whose
// handler replies Reply; it is an engine.Exchange. After engine.Serve,
// Ran tells whether the handler ran, and Answered how the engine answered.
type Call struct {
	key      string
	Reply    []byte
	Ran      bool
	Answered engine.Answer

	running, release chan struct{} // a held call's (duplicate.go); nil for others
}

// Serve serves a call of key on op, whose handler replies reply, and
// returns its answer.
func Serve(ctx context.Context, e *engine.Engine, op *engine.Operation, key string, reply []byte) *Call {
	c := &Call{key: key, Reply: reply}
	e.Serve(ctx, op, c)
	return c
}

// Got is what the call answered: the reply it ran or replayed, or nil.
func (c *Call) Got() []byte {
	switch {
	case c.Answered.Verdict == engine.Executed && c.Answered.StandIn == nil && c.Ran:
		return c.Reply
	case c.Answered.Verdict == engine.Replayed:
		return c.Answered.Outcome
	}
	return nil
}

func (c *Call) Key() (string, bool, error) { return c.key, true, nil }

func (c *Call) FirstSent() []string { return nil }

func (c *Call) FirstRegion() []string { return nil }

func (c *Call) Attempt() engine.Attempt { return engine.Attempt{} }

func (c *Call) Fingerprint(context.Context) (store.Fingerprint, error) {
	return store.Fingerprint{1}, nil
}

func (c *Call) Run(context.Context) engine.HandlerResult {
	c.Ran = true
	if c.release != nil {
		close(c.running)
		<-c.release
	}
	return engine.HandlerResult{Record: c.Reply, KeepWrites: true}
}

func (c *Call) StandIn(error) []byte { return []byte("stand-in") }

func (c *Call) Pass(context.Context) int { return 0 }

func (c *Call) Answer(_ context.Context, a engine.Answer) int {
	c.Answered = a
	return 0
}
