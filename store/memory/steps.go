package memory

import (
	"container/heap"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/idemkey/idemkey/store"
)

// step is the record of a run's step name under key (store.Stepper). It is
// kept in key's shard, so that one lock covers the fence (the key's record)
// and the step.
type step struct {
	key         store.Key
	name        string
	partition   store.Partition // the key's record's when it started: the step counts in its share
	fingerprint store.Fingerprint
	done        bool
	result      []byte
	cost        int64 // what the step counts against the byte bounds, as a record's
	expiresAt   time.Time
	index       int // position in shard.stepsByExpiry
}

// StartStep implements store.Stepper. A step counts as a record with no
// outcome, and expires when the key's record would at its start (its
// removableAt: past its retention while a lease outlasts that).
//
// Token 0 (a run in an open Atomic transaction) is fenced out, ErrLeaseLost,
// like any token no record holds: this store is not store.Atomic, so no run
// holds a key that way.
func (s *Store) StartStep(ctx context.Context, r store.StepStart) (store.StepEntry, error) {
	if err := ctx.Err(); err != nil {
		return store.StepEntry{}, err
	}
	sh := s.shard(r.Key)
	// Made before the lock, as Reserve's record is.
	fresh := &step{key: r.Key, name: r.Name, fingerprint: r.Fingerprint, cost: recordCost}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for evicted := false; ; evicted = true {
		now := s.now()
		rec, err := s.heldLocked(sh, r.Key, r.Token, now)
		if err != nil {
			return store.StepEntry{}, err
		}
		if st := sh.findStep(r.Key, r.Name); st != nil {
			if now.Before(st.expiresAt) {
				state := store.StepStarted
				if st.done {
					state = store.StepDone
				}
				return store.StepEntry{State: state, Fingerprint: st.fingerprint, Result: st.result}, nil
			}
			s.deleteStepLocked(sh, st)
		}
		full := s.take(rec.partition, 1, fresh.cost)
		if full == "" {
			fresh.partition = rec.partition
			fresh.expiresAt = rec.removableAt()
			if sh.steps == nil {
				sh.steps = make(map[store.Key][]*step)
			}
			sh.steps[r.Key] = append(sh.steps[r.Key], fresh)
			heap.Push(&sh.stepsByExpiry, fresh)
			return store.StepEntry{State: store.StepNew}, nil
		}
		if evicted {
			return store.StepEntry{}, fmt.Errorf("memory store: start step %q: %w: no room for its record: %s", r.Name, store.ErrFull, full)
		}
		sh.mu.Unlock() // evictAll takes every shard's lock in turn
		s.evictAll()
		sh.mu.Lock()
	}
}

// FinishStep implements store.Stepper. The step counts its result as a
// completed record counts its outcome.
func (s *Store) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for evicted := false; ; evicted = true {
		now := s.now()
		if _, err := s.heldLocked(sh, key, token, now); err != nil {
			return err
		}
		st := sh.findStep(key, name)
		if st == nil || !now.Before(st.expiresAt) {
			return fmt.Errorf("memory store: finish step %q: not started: %w", name, store.ErrLeaseLost)
		}
		full := s.resize(st.partition, &st.cost, cost(result))
		if full == "" {
			st.done = true
			st.result = result
			return nil
		}
		if evicted {
			return fmt.Errorf("memory store: finish step %q: %w: no room for a result of %d bytes: %s", name, store.ErrFull, len(result), full)
		}
		sh.mu.Unlock()
		s.evictAll()
		sh.mu.Lock()
	}
}

// ForgetSteps implements store.Stepper.
func (s *Store) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, err := s.heldLocked(sh, key, token, s.now()); err != nil {
		return err
	}
	if len(names) == 0 {
		for steps := sh.steps[key]; len(steps) > 0; steps = sh.steps[key] {
			s.deleteStepLocked(sh, steps[len(steps)-1])
		}
	}
	for _, name := range names {
		if st := sh.findStep(key, name); st != nil {
			s.deleteStepLocked(sh, st)
		}
	}
	return nil
}

// findStep returns key's step name, expired or not, or nil. A run has a
// few steps, so they are looked through rather than mapped.
func (sh *shard) findStep(key store.Key, name string) *step {
	for _, st := range sh.steps[key] {
		if st.name == name {
			return st
		}
	}
	return nil
}

func (s *Store) deleteStepLocked(sh *shard, st *step) {
	heap.Remove(&sh.stepsByExpiry, st.index)
	steps := sh.steps[st.key]
	if len(steps) == 1 {
		delete(sh.steps, st.key)
	} else {
		i := slices.Index(steps, st)
		steps[i] = steps[len(steps)-1]
		steps[len(steps)-1] = nil
		sh.steps[st.key] = steps[:len(steps)-1]
	}
	s.give(st.partition, 1, st.cost)
	s.total.records.Add(-1)
	s.total.bytes.Add(-st.cost)
}

// stepHeap orders steps by expiry, soonest first; it implements
// heap.Interface. It is apart from the records' expiryHeap, so that the
// records' path is what it was before steps.
type stepHeap []*step

// due says whether the soonest step is expired at now.
func (h stepHeap) due(now time.Time) bool {
	return len(h) > 0 && !now.Before(h[0].expiresAt)
}

func (h stepHeap) Len() int           { return len(h) }
func (h stepHeap) Less(i, j int) bool { return h[i].expiresAt.Before(h[j].expiresAt) }
func (h stepHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *stepHeap) Push(x any) {
	st := x.(*step)
	st.index = len(*h)
	*h = append(*h, st)
}
func (h *stepHeap) Pop() any {
	old := *h
	st := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return st
}
