package postgres_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// TestReviewOwnStoreDuplicateAsTheHolderCommits: a duplicate in the
// holder's own store, whose Begin crosses the holder's COMMIT (sent
// before any question), finds the key held and must be told as one in
// another store now is (TestAtomicCommitBeforeTheQuestionTells).
func TestReviewOwnStoreDuplicateAsTheHolderCommits(t *testing.T) {
	rs := newReplicas(t, 1)
	st := rs[0].store
	listen(t, st)
	ctx := context.Background()
	untold := 0
	for i := range 200 {
		key := store.ScopeKey("t", "/m", "own-"+strconv.Itoa(i))
		tx := beginAs(t, st, key, store.Acquired)
		got := make(chan store.State, 1)
		go func() {
			res, dtx, err := st.Begin(ctx, store.Reservation{Key: key, Fingerprint: fpA, Lease: lease, Retention: retention})
			if err != nil {
				t.Error(err)
			}
			if dtx != nil {
				dtx.Rollback(ctx)
			}
			got <- res.State
		}()
		time.Sleep(time.Duration(i%16) * 50 * time.Microsecond)
		if err := tx.Commit(ctx, []byte("done"), true); err != nil {
			t.Fatal(err)
		}
		if <-got != store.Held {
			continue
		}
		changed, stop := st.Watch(key)
		select {
		case <-changed:
		case <-time.After(time.Second):
			untold++
		}
		stop()
	}
	if untold > 0 {
		t.Fatalf("%d of 200 duplicates in the holder's own store, found held as it committed, never told", untold)
	}
}
