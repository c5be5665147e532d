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

// DuplicateAnswered measures how long after a running call's Complete
// returns a duplicate held for it (engine.WithInProgressWait) has its
// answer: the first call is served on first, the duplicate on dup, two
// stores of one storage as in two processes, so that dup hears of the
// record as another process would. The duplicate is told by dup's Watch
// (watched), or runs behind a wrapper that hides Watch (polled), where it
// reads the key at its next poll, interleaved. It reports each one's mean
// in microseconds, the Reserves each duplicate made, and the ratio of the
// means.
func DuplicateAnswered(b *testing.B, first, dup store.Watcher) {
	ctx := context.Background()
	newEngine := func(st store.Store) (*engine.Engine, *engine.Operation) {
		e, err := engine.New(st, engine.WithTenant(func(context.Context) (string, error) { return "t", nil }), engine.WithInProgressWait(time.Minute))
		if err != nil {
			b.Fatal(err)
		}
		op, err := e.Operation(engine.OperationSpec{Name: "/bench.v1.Service/Method"})
		if err != nil {
			b.Fatal(err)
		}
		return e, op
	}
	holder := &counted{Store: first.(store.Store), watcher: first}
	he, hop := newEngine(holder)
	type variant struct {
		name     string
		st       *counted
		e        *engine.Engine
		op       *engine.Operation
		spent    time.Duration
		reserves int64
	}
	var variants []*variant
	for _, name := range []string{"watched", "polled"} {
		cs := &counted{Store: dup.(store.Store), watcher: dup}
		var s store.Store = cs
		if name == "polled" {
			s = polled{cs}
		}
		e, op := newEngine(s)
		variants = append(variants, &variant{name: name, st: cs, e: e, op: op})
	}
	run := strconv.FormatInt(time.Now().UnixNano(), 36) // keys of no earlier run
	n := 0
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
	for _, v := range variants {
		b.ReportMetric(float64(v.spent.Microseconds())/float64(n), v.name+"-µs")
		b.ReportMetric(float64(v.reserves)/float64(n), v.name+"-reserves")
	}
	b.ReportMetric(float64(variants[0].spent)/float64(variants[1].spent), "watched/polled")
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
