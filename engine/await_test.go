package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// TestSharedReadTakenOnlyWhenItCannotMiss: duplicates that came while
// another's read of their key was under way take its answer only if it
// found the outcome recorded. A read that may have begun before their
// Watch, found the key held, acquired it for its reader alone, failed, or
// ended with its reader's context is read again, in a read made after;
// none gets an answer meant for another.
func TestSharedReadTakenOnlyWhenItCannotMiss(t *testing.T) {
	storeDown := errors.New("store down")
	for _, tc := range []struct {
		name      string
		first     store.Entry
		firstErr  error
		cancelled bool // the first reader's context ends during its read
		again     bool // the others read again
	}{
		{name: "completed", first: store.Entry{State: store.Completed, Outcome: []byte("o")}},
		{name: "held", first: store.Entry{State: store.Held}, again: true},
		{name: "acquired", first: store.Entry{State: store.Acquired, Token: 7}, again: true},
		{name: "failed", firstErr: storeDown, again: true},
		{name: "cancelled", firstErr: context.Canceled, cancelled: true, again: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const others = 20
			var s reads
			s.byKey = make(map[waited]*read)
			key := waited{key: store.Key{1}}
			inRead, release := make(chan struct{}), make(chan struct{})
			firstCtx, cancel := context.WithCancel(t.Context())
			defer cancel()
			go func() {
				s.poll(firstCtx, key, func(context.Context) (store.Entry, error) {
					close(inRead)
					<-release
					if tc.cancelled {
						cancel()
					}
					return tc.first, tc.firstErr
				})
			}()
			<-inRead
			var reread atomic.Int64
			type answer struct {
				res store.Entry
				err error
			}
			answers := make(chan answer, others)
			for range others {
				go func() {
					res, ok, err := s.poll(t.Context(), key, func(context.Context) (store.Entry, error) {
						reread.Add(1)
						return store.Entry{State: store.Completed, Outcome: []byte("again")}, nil
					})
					if !ok {
						t.Error("poll: not ok, with the context live")
					}
					answers <- answer{res, err}
				}()
			}
			waitSharers(t, &s, key, others)
			close(release)
			for range others {
				var a answer
				select {
				case a = <-answers:
				case <-time.After(30 * time.Second):
					t.Fatal("a duplicate never had its answer")
				}
				want := "o"
				if tc.again {
					want = "again"
				}
				if a.err != nil || a.res.State != store.Completed || string(a.res.Outcome) != want {
					t.Fatalf("answer %v, %q, %v; want completed %q", a.res.State, a.res.Outcome, a.err, want)
				}
			}
			if n := reread.Load(); tc.again != (n > 0) || n > others {
				t.Errorf("the others read %d times (again: %v)", n, tc.again)
			}
		})
	}
}

// TestSharedReadLaterTaken: a read begun after the one a duplicate came
// to is taken whatever it found, even the key held still, so the
// duplicates read it once more between them, not once each.
func TestSharedReadLaterTaken(t *testing.T) {
	const others = 20
	var s reads
	s.byKey = make(map[waited]*read)
	key := waited{key: store.Key{2}}
	held := store.Entry{State: store.Held, RetryAfter: time.Second}
	inRead, release := make(chan struct{}), make(chan struct{})
	go s.poll(t.Context(), key, func(context.Context) (store.Entry, error) {
		close(inRead)
		<-release
		return held, nil
	})
	<-inRead
	var reread atomic.Int64
	secondIn, secondRelease := make(chan struct{}), make(chan struct{})
	answers := make(chan store.Entry, others)
	for range others {
		go func() {
			res, _, _ := s.poll(t.Context(), key, func(context.Context) (store.Entry, error) {
				if reread.Add(1) == 1 {
					close(secondIn)
					<-secondRelease
				}
				return held, nil
			})
			answers <- res
		}()
	}
	waitSharers(t, &s, key, others)
	close(release)
	<-secondIn
	waitSharers(t, &s, key, others-1)
	close(secondRelease)
	for range others {
		if res := <-answers; res.State != store.Held {
			t.Fatalf("answer %v, want held", res.State)
		}
	}
	if n := reread.Load(); n != 1 {
		t.Errorf("%d duplicates read again %d times, want once", others, n)
	}
}

// TestSharedReadWaitEndsWithContext: a duplicate waiting on another's read
// stops when its own context ends, with no answer.
func TestSharedReadWaitEndsWithContext(t *testing.T) {
	var s reads
	s.byKey = make(map[waited]*read)
	key := waited{key: store.Key{3}}
	inRead, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	go s.poll(t.Context(), key, func(context.Context) (store.Entry, error) {
		close(inRead)
		<-release
		return store.Entry{State: store.Completed}, nil
	})
	<-inRead
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, ok, err := s.poll(ctx, key, func(context.Context) (store.Entry, error) {
		t.Error("read made under an ended context while another was under way")
		return store.Entry{}, nil
	}); ok || err != nil {
		t.Fatalf("poll: ok %v, error %v; want not ok, no error", ok, err)
	}
}

// waitSharers waits until n duplicates wait on the read for key under way.
func waitSharers(t *testing.T, s *reads, key waited, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		got := 0
		if r := s.byKey[key]; r != nil {
			got = r.sharers
		}
		s.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d duplicates wait on the read, want %d", got, n)
		}
	}
}

// TestSharedReadOnlyOfOneRequest: a read for one request's duplicates is
// not shared with those of another request of the same key, whose answer
// differs (an atomic Held carries its reader's fingerprint; a record is
// opened only for its own request): the other reads for itself, at once.
func TestSharedReadOnlyOfOneRequest(t *testing.T) {
	var s reads
	s.byKey = make(map[waited]*read)
	key := store.Key{4}
	inRead, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	go s.poll(t.Context(), waited{key: key, fingerprint: store.Fingerprint{1}}, func(context.Context) (store.Entry, error) {
		close(inRead)
		<-release
		return store.Entry{State: store.Held}, nil
	})
	<-inRead
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second) // ends a wait on the read under way
	defer cancel()
	res, ok, err := s.poll(ctx, waited{key: key, fingerprint: store.Fingerprint{2}}, func(context.Context) (store.Entry, error) {
		return store.Entry{State: store.Completed, Fingerprint: store.Fingerprint{2}}, nil
	})
	if !ok || err != nil || res.State != store.Completed || res.Fingerprint != (store.Fingerprint{2}) {
		t.Fatalf("poll of another request: %v (fingerprint %x), %v, %v; want its own read", res.State, res.Fingerprint[:1], ok, err)
	}
	if _, ok, _ := s.poll(ctx, waited{key: key, fingerprint: store.Fingerprint{1}, atomic: true}, func(context.Context) (store.Entry, error) {
		return store.Entry{State: store.Held}, nil
	}); !ok {
		t.Fatal("poll in atomic mode waited on the two-phase read under way")
	}
}

// slowBeginStore is the fake store whose Begin takes a while, as a round
// trip does, so that duplicates polling together would share reads.
type slowBeginStore struct{ *fakeStore }

func (s slowBeginStore) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	time.Sleep(5 * time.Millisecond)
	return s.fakeStore.Begin(ctx, r)
}

// TestAtomicDuplicatesOfTwoRequestsInProgress: an atomic Begin answers a
// key held by an open transaction Held with the caller's own fingerprint
// (store.Atomic), so duplicates of two requests under one key all wait;
// each whose wait runs out is answered in progress, none reused for the
// other request's fingerprint.
func TestAtomicDuplicatesOfTwoRequestsInProgress(t *testing.T) {
	e := mustEngine(t, slowBeginStore{newFakeStore()}, WithInProgressWait(100*time.Millisecond), WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName, Atomic: true})
	if err != nil {
		t.Fatal(err)
	}
	first := executed(t, e, op, req)
	defer first.release(t.Context())
	rs := []request{req, other, req, other, req, other}
	verdicts := make([]Verdict, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() {
			c := e.newCall(op)
			c.start(t.Context(), r)
			verdicts[i] = c.Verdict
		})
	}
	wg.Wait()
	for i, v := range verdicts {
		if v != InProgress {
			t.Errorf("duplicate %d: %v, want in progress", i, v)
		}
	}
}

// onceGatedStore is the memory store whose next Reserve, once armed, waits
// for open to close, telling entered first; every Reserve is counted, and
// every Watch told on watched if there is room.
type onceGatedStore struct {
	*memory.Store
	reserves atomic.Int64
	armed    atomic.Bool
	entered  chan struct{}
	open     chan struct{}
	watched  chan struct{}
}

func (s *onceGatedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	defer s.reserves.Add(1)
	if s.armed.CompareAndSwap(true, false) {
		s.entered <- struct{}{}
		<-s.open
	}
	return s.Store.Reserve(ctx, r)
}

func (s *onceGatedStore) Watch(key store.Key) (<-chan struct{}, func()) {
	select {
	case s.watched <- struct{}{}:
	default:
	}
	return s.Store.Watch(key)
}

// TestWatchTellsAfterATakeover: a holder releases its key and a retry
// takes it over (the Watch taken while the key was free is closed as it
// is taken, and the read it brings forward finds the new holder). The
// duplicate still trusts the store's word: when the new holder records,
// after a few polls, it is answered at once. In a synctest bubble, whose
// clock moves only when every goroutine waits.
func TestWatchTellsAfterATakeover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &onceGatedStore{Store: memory.New(), entered: make(chan struct{}, 1), open: make(chan struct{}), watched: make(chan struct{}, 1)}
		e, op, first := waitingOn(t, st, WithLogger(nil))
		done := started(t.Context(), e, op, req)
		<-st.watched
		st.armed.Store(true)
		first.release(t.Context())
		<-st.entered                      // the duplicate's read, told of the release
		second := executed(t, e, op, req) // the retry that takes the key over
		close(st.open)
		time.Sleep(1200 * time.Millisecond) // the second holder runs over a few polls
		if err := second.record(t.Context(), []byte("outcome"), true); err != nil {
			t.Fatal(err)
		}
		recorded := time.Now()
		dup := receive(t, done)
		if took := time.Since(recorded); dup.Verdict != Replayed || took != 0 {
			t.Fatalf("duplicate: %v %v after the record, want replayed at once", dup.Verdict, took)
		}
	})
}

// hookedStore is a store.Store (no Watcher, Finder or Atomic) whose
// Reserve first calls the hook, if set.
type hookedStore struct {
	store.Store
	hook atomic.Pointer[func(store.Reservation)]
}

func (s *hookedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	if h := s.hook.Load(); h != nil {
		(*h)(r)
	}
	return s.Store.Reserve(ctx, r)
}

// TestSharedReadOpenedForItsOwnRequest: with a sealer, a completed record
// is opened only for a reader of its own request. A duplicate of request
// other waits on a key whose holder releases it to a call of req (await
// waits on any Held, whatever its fingerprint); when req's call records,
// a duplicate of req is answered its reply, opened, by a read of its own,
// while other's duplicate is still reading. In a synctest bubble.
func TestSharedReadOpenedForItsOwnRequest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st := &hookedStore{Store: memory.New()}
		e := mustEngine(t, st, WithSealer(newTestRing(t, 1)), WithInProgressWait(time.Minute), WithLogger(nil))
		op, err := e.Operation(OperationSpec{Name: opName})
		if err != nil {
			t.Fatal(err)
		}
		// hold makes the next Reserves of other's request wait for open.
		hold := func() (chan struct{}, chan struct{}) {
			entered, open := make(chan struct{}, 1), make(chan struct{})
			h := func(r store.Reservation) {
				if r.Fingerprint == other.Fingerprint {
					select {
					case entered <- struct{}{}:
					default:
					}
					<-open
				}
			}
			st.hook.Store(&h)
			return entered, open
		}
		x := executed(t, e, op, other)
		rDone := started(t.Context(), e, op, other)
		synctest.Wait() // r waits for its first poll
		e1, o1 := hold()
		<-e1 // r's poll, held back
		x.release(t.Context())
		y := executed(t, e, op, req)
		e2, o2 := hold() // r's next poll is held back too
		close(o1)        // r finds the key held by y's request, and waits on
		sDone := started(t.Context(), e, op, req)
		<-e2
		synctest.Wait() // s waits
		if err := y.record(t.Context(), []byte(secretReply), true); err != nil {
			t.Fatal(err)
		}
		s := receive(t, sDone) // while r's read is still held back
		if s.Verdict != Replayed || string(s.Outcome) != secretReply {
			t.Fatalf("req's duplicate: %v %.24q (%d bytes), want replayed %q", s.Verdict, s.Outcome, len(s.Outcome), secretReply)
		}
		close(o2)
		if r := receive(t, rDone); r.Verdict != Reused {
			t.Fatalf("other's duplicate: %v, want reused", r.Verdict)
		}
	})
}
