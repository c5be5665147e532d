package postgres

// Probed is how many calls of st's Begin and BeginBatch have run the probe
// on their own, finding every slot taken and no connection to lend (claim).
func Probed(st *Store) int64 { return st.probed.Load() }

// Lent is how many calls of st's wait for a slot in a transaction on a
// lent connection.
func Lent(st *Store) int64 { return st.lent.Load() }

// AtomicSQL is the SQL of st's atomic calls of new keys, for a benchmark
// that sends the same by hand: the lock, the read, and the record.
func AtomicSQL(st *Store) (lock, read, record string) { return st.lockSQL, st.readSQL, st.recordSQL }
