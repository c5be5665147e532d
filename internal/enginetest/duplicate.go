package enginetest

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store"
)

// DuplicateAnswered measures how long after a running call's record (its
// Complete or Commit returned) a duplicate held for it
// (engine.WithInProgressWait) has its answer: the first call is served on
// first, the duplicate on dup, two stores of one storage as in two
// processes, so that dup hears of the record as another process would. The
// duplicate is told by dup's Watch (watched), or runs behind a wrapper that
// hides Watch (polled), where it reads the key at its next poll,
// interleaved. The first call is released as soon as the duplicate has
// found it held, and, in a second run, 2 ms later, as a handler that runs
// on past a round trip. Each run reports each way's mean in microseconds,
// the Reserves each duplicate made, and the ratio of the means. With atomic, the operation runs in atomic mode: the stores must
// implement store.Atomic and store.Finder, and the duplicate's reads (its
// Begin, then Finds) are counted as its Reserves.
func DuplicateAnswered(b *testing.B, first, dup store.Watcher, atomic bool) {
	ctx := context.Background()
	newEngine := func(st store.Store) (*engine.Engine, *engine.Operation) {
		e, err := engine.New(st, engine.WithTenant(func(context.Context) (string, error) { return "t", nil }), engine.WithInProgressWait(time.Minute))
		if err != nil {
			b.Fatal(err)
		}
		op, err := e.Operation(engine.OperationSpec{Name: "/bench.v1.Service/Method", Atomic: atomic})
		if err != nil {
			b.Fatal(err)
		}
		return e, op
	}
	holder := &counted{Store: first.(store.Store), watcher: first}
	he, hop := newEngine(wrap(holder, atomic, true))
	var variants []*variant
	for _, name := range []string{"watched", "polled"} {
		cs := &counted{Store: dup.(store.Store), watcher: dup}
		e, op := newEngine(wrap(cs, atomic, name == "watched"))
		variants = append(variants, &variant{name: name, st: cs, e: e, op: op})
	}
	for _, late := range []time.Duration{0, 2 * time.Millisecond} {
		b.Run("released-after-"+late.String(), func(b *testing.B) {
			for _, v := range variants {
				v.spent, v.reserves = 0, 0
			}
			n := duplicates(b, ctx, he, hop, holder, variants, late)
			for _, v := range variants {
				b.ReportMetric(float64(v.spent.Microseconds())/float64(n), v.name+"-µs")
				b.ReportMetric(float64(v.reserves)/float64(n), v.name+"-reserves")
			}
			b.ReportMetric(float64(variants[0].spent)/float64(variants[1].spent), "watched/polled")
		})
	}
}

// variant is one way a duplicate is served: told (watched) or polled.
type variant struct {
	name     string
	st       *counted
	e        *engine.Engine
	op       *engine.Operation
	spent    time.Duration // from the first call's record to the duplicate's answer
	reserves int64
}

// duplicates runs DuplicateAnswered's loop: the first call is released late
// after the duplicate's first read, as a handler that runs on past it.
func duplicates(b *testing.B, ctx context.Context, he *engine.Engine, hop *engine.Operation, holder *counted, variants []*variant, late time.Duration) (n int) {
	run := strconv.FormatInt(time.Now().UnixNano(), 36) // keys of no earlier run
	for b.Loop() {
		for j := range variants {
			v := variants[(n+j)%len(variants)]
			key := run + v.name + strconv.Itoa(n)
			firstCall := held(key)
			firstDone := make(chan struct{})
			go func() { he.Serve(ctx, hop, firstCall); close(firstDone) }()
			<-firstCall.running
			reserves := v.st.reserves.Load()
			dupCall := held(key)
			dupDone := make(chan time.Time, 1)
			go func() { v.e.Serve(ctx, v.op, dupCall); dupDone <- time.Now() }()
			for v.st.reserves.Load() == reserves { // until the duplicate finds the key held
				runtime.Gosched()
			}
			time.Sleep(late)
			close(firstCall.release)
			<-firstDone
			answered := <-dupDone
			if dupCall.Answered.Verdict != engine.Replayed || string(dupCall.Answered.Outcome) != "reply" {
				b.Fatalf("duplicate: verdict %v, outcome %q; want replayed, reply", dupCall.Answered.Verdict, dupCall.Answered.Outcome)
			}
			v.spent += answered.Sub(time.Unix(0, holder.completed.Load()))
			v.reserves += v.st.reserves.Load() - reserves
		}
		n++
	}
	return n
}

// held is a call of key whose handler, once running is closed, runs until
// release is closed, and replies "reply".
func held(key string) *Call {
	return &Call{key: key, Reply: []byte("reply"), running: make(chan struct{}), release: make(chan struct{})}
}

// counted is a store whose Reserves are counted, with the time of its last
// Complete's return.
type counted struct {
	store.Store
	watcher   store.Watcher
	reserves  atomic.Int64
	completed atomic.Int64 // UnixNano
}

func (s *counted) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := s.Store.Reserve(ctx, r)
	s.reserves.Add(1)
	return res, err
}

func (s *counted) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	err := s.Store.Complete(ctx, key, token, outcome)
	s.completed.Store(time.Now().UnixNano())
	return err
}

func (s *counted) Watch(key store.Key) (<-chan struct{}, func()) { return s.watcher.Watch(key) }

// wrap is cs as the engine is to see it: with Watch if watched, and with
// Begin and Find if atomic.
func wrap(cs *counted, atomic, watched bool) store.Store {
	switch {
	case atomic && watched:
		return countedAtomic{cs}
	case atomic:
		return polledAtomic{polled{cs}}
	case watched:
		return cs
	}
	return polled{cs}
}

// countedAtomic is a counted store in atomic mode, whose Begins and Finds
// are counted as Reserves, and whose transactions' commits as Completes.
type countedAtomic struct{ *counted }

func (s countedAtomic) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	res, tx, err := s.Store.(store.Atomic).Begin(ctx, r)
	s.reserves.Add(1)
	if tx != nil {
		tx = timedTx{tx, &s.completed}
	}
	return res, tx, err
}

func (s countedAtomic) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	res, ok, err := s.Store.(store.Finder).Find(ctx, key)
	s.reserves.Add(1)
	return res, ok, err
}

// polledAtomic is a countedAtomic that hides Watch.
type polledAtomic struct{ polled }

func (p polledAtomic) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	return countedAtomic{p.s}.Begin(ctx, r)
}

func (p polledAtomic) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	return countedAtomic{p.s}.Find(ctx, key)
}

// timedTx notes the time its Commit returned.
type timedTx struct {
	store.Tx
	committed *atomic.Int64 // UnixNano
}

func (t timedTx) Commit(ctx context.Context, outcome []byte, keepWrites bool) error {
	err := t.Tx.Commit(ctx, outcome, keepWrites)
	t.committed.Store(time.Now().UnixNano())
	return err
}

// polled is a counted store that hides Watch (and every other optional
// interface).
type polled struct{ s *counted }

func (p polled) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	return p.s.Reserve(ctx, r)
}

func (p polled) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	return p.s.Complete(ctx, key, token, outcome)
}

func (p polled) Release(ctx context.Context, key store.Key, token store.Token) error {
	return p.s.Release(ctx, key, token)
}
