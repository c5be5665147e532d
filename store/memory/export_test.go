package memory

// RecordCost is what a record counts against WithMaxBytes before its outcome.
const RecordCost = recordCost

// Watched is how many keys duplicates wait for (Watch).
func (s *Store) Watched() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.waitMu.Lock()
		n += sh.waiting.Len()
		sh.waitMu.Unlock()
	}
	return n
}
