package memory

// RecordCost is what a record counts against WithMaxBytes before its outcome.
const RecordCost = recordCost

// Watched is how many keys duplicates wait for (Watch).
func (s *Store) Watched() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting.Len()
}
