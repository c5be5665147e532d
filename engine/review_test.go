package engine

import (
	"bytes"
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// slowBeginStore is the fake store whose Begin takes a while, as a round
// trip does, so that duplicates polling at once share reads.
type slowBeginStore struct{ *fakeStore }

func (s slowBeginStore) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	time.Sleep(15 * time.Millisecond)
	return s.fakeStore.Begin(ctx, r)
}

// TestReviewAtomicSharedHeldKeepsOwnFingerprint: in atomic mode Begin
// answers a key held by an open transaction Held with the caller's own
// fingerprint (store.Atomic). Two duplicates of a running atomic call that
// send different requests under one key all wait, and share their reads:
// the one whose wait runs out on the other's read must still be answered
// InProgress, not Reused (the other's fingerprint).
func TestReviewAtomicSharedHeldKeepsOwnFingerprint(t *testing.T) {
	st := slowBeginStore{newFakeStore()}
	e := mustEngine(t, st, WithInProgressWait(400*time.Millisecond), WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName, Atomic: true})
	if err != nil {
		t.Fatal(err)
	}
	first := e.newCall(op)
	if first.start(t.Context(), req); first.Verdict != Executed {
		t.Fatalf("first call: %v", first.Verdict)
	}
	defer first.release(t.Context())
	for round := range 10 {
		var wg sync.WaitGroup
		rs := []request{req, other, req, other, req, other}
		verdicts := make([]Verdict, len(rs))
		for i, r := range rs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := e.newCall(op)
				c.start(t.Context(), r)
				verdicts[i] = c.Verdict
			}()
		}
		wg.Wait()
		for i, v := range verdicts {
			if v != InProgress {
				t.Fatalf("round %d: duplicate %d (its own request, of a key whose holder's fingerprint no one can read): %v, want InProgress", round, i, v)
			}
		}
	}
}

// gatedStore is the memory store whose Reserves of fingerprint gated wait
// for open to close, telling entered first.
type gatedStore struct {
	*memory.Store
	gated   store.Fingerprint
	entered chan struct{}
	open    chan struct{}
}

func (s *gatedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	if r.Fingerprint == s.gated {
		s.entered <- struct{}{}
		<-s.open
	}
	return s.Store.Reserve(ctx, r)
}

// TestReviewSharedReadOpenedForAnother: with a sealer, a completed record is
// opened only for a reader of its own fingerprint (Engine.opened). A
// duplicate with another fingerprint (one that kept waiting on a key whose
// holder was released and taken over by another request, since await
// waits on any Held) reads the completed record for the others; a
// duplicate of the record's own request that shares that read must not
// replay the sealed bytes.
func TestReviewSharedReadOpenedForAnother(t *testing.T) {
	st := &gatedStore{Store: memory.New(), gated: other.Fingerprint, entered: make(chan struct{}, 1), open: make(chan struct{})}
	e := mustEngine(t, st, WithSealer(newTestRing(t, 1)), WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	// The record of req's request, completed (sealed) through the engine.
	first := e.newCall(op)
	if first.start(t.Context(), req); first.Verdict != Executed {
		t.Fatalf("first call: %v", first.Verdict)
	}
	if err := first.record(t.Context(), []byte(secretReply), true); err != nil {
		t.Fatal(err)
	}
	key := first.key
	resOf := func(r request) store.Reservation {
		return store.Reservation{Key: key, Fingerprint: r.Fingerprint, Lease: time.Minute, Retention: time.Hour}
	}
	// The duplicate of other's request reads first; req's duplicate comes
	// during its read, as the Watch tells them both at once.
	go e.reads.poll(t.Context(), key, func(ctx context.Context) (store.Entry, error) { return e.reserve(ctx, resOf(other)) })
	<-st.entered
	got := make(chan store.Entry, 1)
	go func() {
		res, _, _ := e.reads.poll(t.Context(), key, func(ctx context.Context) (store.Entry, error) { return e.reserve(ctx, resOf(req)) })
		got <- res
	}()
	waitSharers(t, &e.reads, key, 1)
	close(st.open)
	res := <-got
	if res.State == store.Completed && res.Fingerprint == req.Fingerprint && !bytes.Equal(res.Outcome, []byte(secretReply)) {
		t.Fatalf("req's duplicate would replay %q (sealed), want %q", res.Outcome, secretReply)
	}
}

// onceGatedStore is the memory store whose next Reserve, once armed, waits
// for open to close, telling entered first; every Reserve is counted.
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

// TestReviewTakeoverSpendsTheWatchForGood: a holder that releases and a
// new call that takes the key over (an ordinary event: a retry that
// arrives as the first attempt fails) spends both reads the store's word
// may bring forward in vain, since the Watch taken while the key was free
// is closed already. The duplicate then ignores the Watch for the rest of
// its wait: when the new holder records, a second later, it is answered
// at its next poll (up to awaitMaxPoll late), not at once, as it was
// before the change (which dropped the Watch until the next poll only).
func TestReviewTakeoverSpendsTheWatchForGood(t *testing.T) {
	st := &onceGatedStore{Store: memory.New(), entered: make(chan struct{}, 1), open: make(chan struct{}), watched: make(chan struct{}, 1)}
	e := mustEngine(t, st, WithInProgressWait(time.Hour), WithLogger(nil))
	e.firstPoll = time.Hour
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	first := e.newCall(op)
	if first.start(t.Context(), req); first.Verdict != Executed {
		t.Fatalf("first call: %v", first.Verdict)
	}
	done := make(chan *call, 1)
	go func() {
		dup := e.newCall(op)
		dup.start(t.Context(), req)
		done <- &dup
	}()
	<-st.watched
	st.armed.Store(true)
	first.release(t.Context())
	<-st.entered // the duplicate's read, told of the release
	second := e.newCall(op)
	if second.start(t.Context(), req); second.Verdict != Executed {
		t.Fatalf("the retry that takes the key over: %v", second.Verdict)
	}
	close(st.open)
	// The second holder runs a while, over a few polls.
	time.Sleep(1200 * time.Millisecond)
	n := st.reserves.Load()
	for st.reserves.Load() == n { // just after a poll
		time.Sleep(time.Millisecond)
	}
	if err := second.record(t.Context(), []byte("outcome"), true); err != nil {
		t.Fatal(err)
	}
	recorded := time.Now()
	select {
	case dup := <-done:
		if took := time.Since(recorded); dup.Verdict != Replayed || took > 200*time.Millisecond {
			t.Fatalf("duplicate: %v %v after the record, want replayed at once", dup.Verdict, took)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no answer")
	}
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

// TestReviewDuplicateReplaysSealedBytes is TestReviewSharedReadOpenedForAnother
// through Start: a duplicate of request other waits on a key whose holder
// releases it and a call of req takes it over (await waits on any Held,
// whatever its fingerprint); a duplicate of req waits too; when req's call
// records, other's duplicate polls first and req's shares that read.
func TestReviewDuplicateReplaysSealedBytes(t *testing.T) {
	st := &hookedStore{Store: memory.New()}
	e := mustEngine(t, st, WithSealer(newTestRing(t, 1)), WithInProgressWait(time.Minute), WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	// block makes the next Reserves of other's request wait for open.
	block := func() (chan struct{}, chan struct{}) {
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
	x := e.newCall(op)
	if x.start(t.Context(), other); x.Verdict != Executed {
		t.Fatalf("x: %v", x.Verdict)
	}
	rDone := make(chan *call, 1)
	go func() {
		r := e.newCall(op)
		r.start(t.Context(), other)
		rDone <- &r
	}()
	time.Sleep(10 * time.Millisecond) // r waits
	e1, o1 := block()
	<-e1 // r's poll, held back
	x.release(t.Context())
	y := e.newCall(op)
	if y.start(t.Context(), req); y.Verdict != Executed {
		t.Fatalf("y: %v", y.Verdict)
	}
	e2, o2 := block() // r's next poll is held back too
	close(o1)         // r finds the key held by y's request, and waits on
	sDone := make(chan *call, 1)
	go func() {
		s := e.newCall(op)
		s.start(t.Context(), req)
		sDone <- &s
	}()
	<-e2
	if err := y.record(t.Context(), []byte(secretReply), true); err != nil {
		t.Fatal(err)
	}
	waitSharers(t, &e.reads, y.key, 1) // s's poll comes to r's read
	close(o2)
	s := <-sDone
	r := <-rDone
	if s.Verdict != Replayed || string(s.Outcome) != secretReply {
		t.Fatalf("req's duplicate: %v %.24q... (%d bytes, sealed), want replayed %q (other's: %v)", s.Verdict, s.Outcome, len(s.Outcome), secretReply, r.Verdict)
	}
}
