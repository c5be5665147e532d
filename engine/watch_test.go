package engine

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// watchedStore is the memory store, with its Reserves counted and each
// Watch told on watched, if there is room.
type watchedStore struct {
	*memory.Store
	reserves atomic.Int64
	watched  chan struct{}
}

func (s *watchedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.reserves.Add(1)
	return s.Store.Reserve(ctx, r)
}

func (s *watchedStore) Watch(key store.Key) (<-chan struct{}, func()) {
	changed, stop := s.Store.Watch(key)
	select {
	case s.watched <- struct{}{}:
	default: // no one is listening
	}
	return changed, stop
}

// TestWatchAnswersTheDuplicate: on a store.Watcher, a duplicate held for a
// running call is answered as soon as that call records or releases its
// key, with one read more, not at its next poll: here an hour away.
func TestWatchAnswersTheDuplicate(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(t *testing.T, first *call)
		want Verdict
	}{
		{"recorded", func(t *testing.T, first *call) {
			if err := first.record(t.Context(), []byte("outcome-1"), true); err != nil {
				t.Fatalf("Record: %v", err)
			}
		}, Replayed},
		{"released", func(t *testing.T, first *call) { first.release(t.Context()) }, Executed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &watchedStore{Store: memory.New(), watched: make(chan struct{}, 8)}
			e := mustEngine(t, st, WithInProgressWait(time.Hour))
			e.firstPoll = time.Hour
			op, err := e.Operation(OperationSpec{Name: opName})
			if err != nil {
				t.Fatal(err)
			}
			first := e.newCall(op)
			if first.start(t.Context(), req); first.Verdict != Executed {
				t.Fatalf("first call: verdict %v, want executed", first.Verdict)
			}
			done := make(chan *call, 1)
			go func() {
				dup := e.newCall(op)
				dup.start(t.Context(), req)
				done <- &dup
			}()
			select {
			case <-st.watched: // the duplicate waits
			case <-time.After(30 * time.Second):
				t.Fatal("the duplicate never watched its key")
			}
			tc.end(t, &first)
			dup := receive(t, done)
			if dup.Verdict != tc.want {
				t.Fatalf("duplicate: verdict %v, want %v", dup.Verdict, tc.want)
			}
			if tc.want == Replayed && string(dup.Outcome) != "outcome-1" {
				t.Fatalf("duplicate: outcome %q, want outcome-1", dup.Outcome)
			}
			// The first call's, the duplicate's, and the one read it was told to make.
			if n := st.reserves.Load(); n != 3 {
				t.Errorf("Reserve called %d times, want 3", n)
			}
		})
	}
}

// wrongStore is the memory store whose Watch always says the key changed,
// as a store that cannot tell does, with its Reserves counted.
type wrongStore struct {
	*memory.Store
	reserves atomic.Int64
}

func (s *wrongStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.reserves.Add(1)
	return s.Store.Reserve(ctx, r)
}

func (s *wrongStore) Watch(store.Key) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	close(ch)
	return ch, func() {}
}

// TestWatchToldWronglyPollsOnSchedule: a Watch that is closed at once
// while the key is held makes a duplicate read no more often than the
// polls' schedule, not in a loop of reads for its whole wait.
func TestWatchToldWronglyPollsOnSchedule(t *testing.T) {
	st := &wrongStore{Store: memory.New()}
	const wait = 1200 * time.Millisecond
	e := mustEngine(t, st, WithInProgressWait(wait))
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	first := e.newCall(op)
	if first.start(t.Context(), req); first.Verdict != Executed {
		t.Fatalf("first call: verdict %v, want executed", first.Verdict)
	}
	dup := e.newCall(op)
	if dup.start(t.Context(), req); dup.Verdict != InProgress {
		t.Fatalf("duplicate: verdict %v, want in progress after its wait", dup.Verdict)
	}
	// The first call's Reserve, the duplicate's, its one read on the word
	// of the first Watch, and the polls of a wait of 1.2 s: at most
	// 5 + wait/awaitMaxPoll.
	if n, most := st.reserves.Load(), int64(3+5+wait/awaitMaxPoll); n > most {
		t.Errorf("Reserve called %d times in a wait of %v; want at most %d", n, wait, most)
	}
}

// BenchmarkDuplicateAnswered measures how long after a running call records
// its outcome a duplicate held for it has its answer: on the memory store,
// which tells the duplicate (store.Watcher), and on the same store behind a
// wrapper that hides Watch, where the duplicate reads the key at its next
// poll, interleaved. It reports each one's mean in microseconds, and their
// ratio.
func BenchmarkDuplicateAnswered(b *testing.B) {
	type variant struct {
		name  string
		e     *Engine
		op    *Operation
		st    *watchedStore
		spent time.Duration
	}
	var variants []*variant
	for _, name := range []string{"watched", "polled"} {
		st := &watchedStore{Store: memory.New(memory.WithMaxRecords(1 << 30)), watched: make(chan struct{})}
		var s store.Store = st
		if name == "polled" {
			s = plainStore{st}
		}
		e := mustEngine(b, s, WithInProgressWait(time.Minute))
		op, err := e.Operation(OperationSpec{Name: opName})
		if err != nil {
			b.Fatal(err)
		}
		variants = append(variants, &variant{name: name, e: e, op: op, st: st})
	}
	n := 0
	for b.Loop() {
		for j := range variants {
			v := variants[(n+j)%len(variants)]
			r := request{Tenant: "t", Key: "k" + strconv.Itoa(n), Fingerprint: req.Fingerprint}
			first := v.e.newCall(v.op)
			if first.start(b.Context(), r); first.Verdict != Executed {
				b.Fatalf("first call: verdict %v", first.Verdict)
			}
			reserves := v.st.reserves.Load()
			done := make(chan time.Time, 1)
			go func() {
				dup := v.e.newCall(v.op)
				dup.start(b.Context(), r)
				done <- time.Now()
			}()
			for v.st.reserves.Load() == reserves { // until the duplicate finds the key held
				runtime.Gosched()
			}
			recorded := time.Now()
			if err := first.record(b.Context(), []byte("outcome"), true); err != nil {
				b.Fatal(err)
			}
			v.spent += (<-done).Sub(recorded)
		}
		n++
	}
	for _, v := range variants {
		b.ReportMetric(float64(v.spent.Microseconds())/float64(n), v.name+"-µs")
	}
	b.ReportMetric(float64(variants[0].spent)/float64(variants[1].spent), "watched/polled")
}
