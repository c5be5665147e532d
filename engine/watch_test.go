package engine

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// watchedStore is the memory store, with its Reserves counted and each
// Watch told on watched, if there is room. While gate holds a channel,
// each Reserve waits for it to close.
type watchedStore struct {
	*memory.Store
	reserves atomic.Int64
	watched  chan struct{}
	gate     atomic.Pointer[chan struct{}]
}

func (s *watchedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.reserves.Add(1)
	if gate := s.gate.Load(); gate != nil {
		<-*gate
	}
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

// waitingOn is an engine on st whose duplicates wait an hour with no poll
// due in it, so that only the store's Watch answers them, its operation,
// and a first call of req, which holds the key.
func waitingOn(t *testing.T, st store.Store, opts ...Option) (*Engine, *Operation, *call) {
	t.Helper()
	e := mustEngine(t, st, append([]Option{WithInProgressWait(time.Hour)}, opts...)...)
	e.firstPoll = time.Hour
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	return e, op, executed(t, e, op, req)
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
			e, op, first := waitingOn(t, st)
			done := started(t.Context(), e, op, req)
			select {
			case <-st.watched: // the duplicate waits
			case <-time.After(30 * time.Second):
				t.Fatal("the duplicate never watched its key")
			}
			tc.end(t, first)
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

// TestWatchFloodReadsOnce: a flood of duplicates held for one running call,
// told together that it recorded, read the key once between them, not once
// each, and each replays the outcome.
func TestWatchFloodReadsOnce(t *testing.T) {
	const dups = 50
	st := &watchedStore{Store: memory.New(), watched: make(chan struct{}, dups)}
	e, op, first := waitingOn(t, st)
	done := make([]<-chan *call, dups)
	for i := range done {
		done[i] = started(t.Context(), e, op, req)
	}
	for range dups { // every duplicate waits
		select {
		case <-st.watched:
		case <-time.After(30 * time.Second):
			t.Fatal("a duplicate never watched its key")
		}
	}
	gate := make(chan struct{})
	st.gate.Store(&gate)
	reserves := st.reserves.Load()
	if err := first.record(t.Context(), []byte("outcome-1"), true); err != nil {
		t.Fatalf("Record: %v", err)
	}
	// The first duplicate's read waits at the gate until every other
	// duplicate waits on it.
	waitSharers(t, &e.reads, waited{key: first.key, fingerprint: req.Fingerprint}, dups-1)
	close(gate)
	for _, done := range done {
		if dup := receive(t, done); dup.Verdict != Replayed || string(dup.Outcome) != "outcome-1" {
			t.Fatalf("duplicate: verdict %v, outcome %q; want replayed outcome-1", dup.Verdict, dup.Outcome)
		}
	}
	if n := st.reserves.Load() - reserves; n != 1 {
		t.Errorf("%d duplicates told of the record read it %d times, want once", dups, n)
	}
}

// toldDuringStore is the memory store whose first Watch is closed at once,
// and whose third Reserve, once it has decided, waits for gate, telling
// inRead.
type toldDuringStore struct {
	*memory.Store
	reserves, watches atomic.Int64
	inRead, gate      chan struct{}
}

func (s *toldDuringStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	res, err := s.Store.Reserve(ctx, r)
	if s.reserves.Add(1) == 3 {
		close(s.inRead)
		<-s.gate
	}
	return res, err
}

func (s *toldDuringStore) Watch(key store.Key) (<-chan struct{}, func()) {
	if s.watches.Add(1) == 1 {
		ch := make(chan struct{})
		close(ch)
		return ch, func() {}
	}
	return s.Store.Watch(key)
}

// TestWatchToldDuringARead: a duplicate whose read found the key held,
// and that was told during the read that the key changed (the first call
// recorded after the read had decided), reads again at once, not at its
// next poll. In a synctest bubble, whose clock moves only when every
// goroutine waits, it is answered with no time gone by.
func TestWatchToldDuringARead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &toldDuringStore{Store: memory.New(), inRead: make(chan struct{}), gate: make(chan struct{})}
		e, op, first := waitingOn(t, st)
		began := time.Now()
		done := started(t.Context(), e, op, req)
		<-st.inRead // the duplicate's read, told by the first Watch, found the key held
		if err := first.record(t.Context(), []byte("outcome-1"), true); err != nil {
			t.Fatalf("Record: %v", err)
		}
		close(st.gate)
		if dup := receive(t, done); dup.Verdict != Replayed || string(dup.Outcome) != "outcome-1" {
			t.Fatalf("duplicate: verdict %v, outcome %q; want replayed outcome-1", dup.Verdict, dup.Outcome)
		}
		if waited := time.Since(began); waited != 0 {
			t.Errorf("the duplicate was answered after %v, want at once", waited)
		}
		if n := st.reserves.Load(); n != 4 {
			t.Errorf("Reserve called %d times, want 4: the first call's, the duplicate's, and its two reads", n)
		}
	})
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
