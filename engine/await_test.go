package engine

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
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
			s.byKey = make(map[store.Key]*read)
			key := store.Key{1}
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
	s.byKey = make(map[store.Key]*read)
	key := store.Key{2}
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
	s.byKey = make(map[store.Key]*read)
	key := store.Key{3}
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

// waitSharers waits until n duplicates wait on the read of key under way.
func waitSharers(t *testing.T, s *reads, key store.Key, n int) {
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
