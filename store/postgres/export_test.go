package postgres

import (
	"time"

	"github.com/idemkey/idemkey/store"
)

// Probed is how many calls of st's Begin and BeginBatch have run the probe
// on their own, finding every slot taken and no connection to lend (claim).
func Probed(st *Store) int64 { return st.probed.Load() }

// Lent is how many calls of st's wait for a slot in a transaction on a
// lent connection.
func Lent(st *Store) int64 { return st.lent.Load() }

// AtomicSQL is the SQL of st's atomic calls of new keys, for a benchmark
// that sends the same by hand: the lock, the read, and the record.
func AtomicSQL(st *Store) (lock, read, record string) { return st.lockSQL, st.readSQL, st.recordSQL }

// Listens reports whether st's Listen has a connection that listens.
func Listens(st *Store) bool { return st.watch.live.Load() }

// SetClockOffset adds offset() to the clock of st's Watch, for a test that
// moves the database's view of time (an Advance).
func SetClockOffset(st *Store, offset func() time.Duration) { st.watch.offset = offset }

// Wanted reports whether another store asked st, which holds key in an
// atomic call, to notify its record.
func Wanted(st *Store, key store.Key) bool {
	st.watch.mu.Lock()
	defer st.watch.mu.Unlock()
	return st.watch.held[key].wanted
}
