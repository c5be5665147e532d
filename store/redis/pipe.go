package redis

import (
	"context"
	"errors"

	goredis "github.com/redis/go-redis/v9"
)

// How concurrent calls share their writes. go-redis sends each command on a
// connection of its pool, a write and a read of its own; while others of
// the store's calls are in flight, a script goes through the client's
// AutoPipeline instead, which sends the scripts of the callers waiting at
// that moment in one write and reads their replies in one (BENCHMARKS.md,
// "Pipelining: measured"). A call with few beside it keeps the plain path,
// which costs it less. The client's AutoPipelineOptions configure it. Not with the
// client's ContextTimeoutEnabled: a queued command runs on the
// autopipeliner's context, so the caller's deadline would not end its
// wait. Nor for a write that waits for replicas, whose WAIT must follow on
// its connection. The autopipeliner is the client's, shared with its other
// users, and ends with the client.

// pipelineFrom is how many calls in flight, a call's own included, make it
// go through the autopipeliner. With two, each goes alone into a batch of
// its own: 0.84-0.88 times the calls per second at 1.19 times the CPU of
// the plain path, from two goroutines (BENCHMARKS.md).
const pipelineFrom = 3

// eval runs sc, through the autopipeliner while other calls are in flight.
func (s *Store) eval(ctx context.Context, sc *goredis.Script, keys []string, args []any) (any, error) {
	defer s.inflight.Add(-1)
	if s.inflight.Add(1) >= pipelineFrom {
		if ap := s.pipeline(); ap != nil {
			v, err := sc.Run(ctx, ap, keys, args...).Result()
			if !errors.Is(err, goredis.ErrClosed) {
				return v, err
			}
			// Closed, and the script not sent: by the client's Close,
			// which the plain path reports too, or by a Close of the
			// client's autopipeliner, which the next call makes anew.
			s.pipe.CompareAndSwap(ap, nil)
		}
	}
	return sc.Run(ctx, s.client, keys, args...).Result()
}

// pipeline returns the client's autopipeliner, made at the first call that
// needs it; nil where the store does not pipeline, or the client has none
// (closed, or its AutoPipelineOptions are invalid).
func (s *Store) pipeline() *goredis.AutoPipeliner {
	if !s.pipelines {
		return nil
	}
	if ap := s.pipe.Load(); ap != nil {
		return ap
	}
	ap, err := s.client.AutoPipeline()
	if err != nil {
		return nil
	}
	s.pipe.Store(ap)
	return ap
}

// contextTimeouts reports whether client honours contexts' deadlines on
// its sockets (ContextTimeoutEnabled).
func contextTimeouts(client goredis.UniversalClient) bool {
	switch c := client.(type) {
	case *goredis.Client:
		return c.Options().ContextTimeoutEnabled
	case *goredis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}
