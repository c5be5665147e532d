package postgres

// Probed is how many calls of st's Begin and BeginBatch have run the probe
// on their own, finding every slot taken and no connection to lend (claim).
func Probed(st *Store) int64 { return st.probed.Load() }

// Lent is how many calls of st's wait for a slot in a transaction on a
// lent connection.
func Lent(st *Store) int64 { return st.lent.Load() }
