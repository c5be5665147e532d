// Package memory is an in-process idemkey store, for tests and for services
// that run as a single process and accept that a restart forgets every key.
//
// It is safe for concurrent use, and bounded: at most WithMaxRecords records
// (DefaultMaxRecords) and WithMaxBytes bytes (DefaultMaxBytes), counting each
// record as recordCost bytes plus what its outcome holds beyond
// store.SmallOutcome. Every Reserve deletes a few expired records, and Sweep
// deletes the rest on demand, so no goroutine runs in the background.
//
// At a bound, expired records go first; if the store is still full, Reserve
// of a new key returns store.ErrFull (the interceptor answers
// ResourceExhausted, reason IDEMPOTENCY_STORE_FULL, and the handler does not
// run), and so does Complete of an outcome with no room left (the interceptor
// then records a short Internal instead). Replays of recorded keys go on
// working. Measured on a flood of unique keys and of large replies, the heap
// of a process stays within about three times WithMaxBytes above its size
// before (see TestFloodStaysBounded).
package memory

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemkey/idemkey/store"
)

// Defaults for the store's bounds, each changed by the option that names it.
// Together they keep a store on a laptop under about 100 MB of heap.
const (
	DefaultMaxRecords = 100_000  // WithMaxRecords
	DefaultMaxBytes   = 64 << 20 // WithMaxBytes
)

// recordCost is what one record counts against WithMaxBytes before its
// outcome: its map entry, its struct and its place in the heap (about 300
// bytes measured), with room for an outcome of store.SmallOutcome bytes.
const recordCost = 512

// evictPerReserve is how many expired records each Reserve deletes; more than
// one, so that deletion outpaces insertion and memory stays bounded.
const evictPerReserve = 2

// Store is an in-memory store.Store.
type Store struct {
	now func() time.Time

	maxRecords int
	maxBytes   int64

	mu        sync.Mutex
	records   map[store.Key]*record
	byExpiry  expiryHeap // every record, soonest removable first
	bytes     int64      // the cost of every record, as cost counts it
	lastToken store.Token
}

type record struct {
	key         store.Key
	fingerprint store.Fingerprint
	token       store.Token
	completed   bool
	outcome     []byte
	leaseEnd    time.Time
	expiresAt   time.Time
	index       int // position in Store.byExpiry
}

// removableAt is when the record becomes expired: its retention has passed and
// it holds no live lease.
func (r *record) removableAt() time.Time {
	if !r.completed && r.leaseEnd.After(r.expiresAt) {
		return r.leaseEnd
	}
	return r.expiresAt
}

// Option configures a Store.
type Option func(*Store)

// WithClock makes the store read the time from now instead of time.Now, so
// tests can move time forward without sleeping.
func WithClock(now func() time.Time) Option {
	return func(s *Store) { s.now = now }
}

// WithMaxRecords bounds the number of records, expired ones included until
// they are deleted (DefaultMaxRecords if n < 1).
func WithMaxRecords(n int) Option {
	return func(s *Store) { s.maxRecords = n }
}

// WithMaxBytes bounds the bytes the records count (DefaultMaxBytes if n < 1):
// recordCost each, plus what each outcome holds beyond store.SmallOutcome. A
// bound below what one record needs is raised to that.
func WithMaxBytes(n int64) Option {
	return func(s *Store) { s.maxBytes = n }
}

// New returns an empty store.
func New(opts ...Option) *Store {
	s := &Store{now: time.Now, records: make(map[store.Key]*record)}
	for _, opt := range opts {
		opt(s)
	}
	if s.maxRecords < 1 {
		s.maxRecords = DefaultMaxRecords
	}
	if s.maxBytes < 1 {
		s.maxBytes = DefaultMaxBytes
	}
	s.maxBytes = max(s.maxBytes, recordCost)
	return s
}

// cost is what a record with outcome counts against the byte bound.
func cost(outcome []byte) int64 {
	return recordCost + int64(max(len(outcome)-store.SmallOutcome, 0))
}

// roomLocked reports whether records of extra more bytes fit, after deleting
// every expired record if they would not.
func (s *Store) roomLocked(now time.Time, newRecords int, extra int64) bool {
	fits := func() bool { return len(s.records)+newRecords <= s.maxRecords && s.bytes+extra <= s.maxBytes }
	if fits() {
		return true
	}
	s.evictLocked(now, len(s.byExpiry))
	return fits()
}

var (
	_ store.Store   = (*Store)(nil)
	_ store.Finder  = (*Store)(nil)
	_ store.Sweeper = (*Store)(nil)
)

// Reserve implements store.Store.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Result, error) {
	if err := ctx.Err(); err != nil {
		return store.Result{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.evictLocked(now, evictPerReserve)

	rec, ok := s.records[r.Key]
	if ok && !now.Before(rec.removableAt()) {
		s.deleteLocked(rec)
		ok = false
	}
	switch {
	case !ok:
		if !s.roomLocked(now, 1, recordCost) {
			return store.Result{}, fmt.Errorf("memory store: reserve: %w: %d records, %d of %d bytes", store.ErrFull, len(s.records), s.bytes, s.maxBytes)
		}
		s.lastToken++
		rec = &record{
			key:         r.Key,
			fingerprint: r.Fingerprint,
			token:       s.lastToken,
			leaseEnd:    now.Add(max(r.Lease, 0)),
			expiresAt:   now.Add(max(r.Retention, 0)),
		}
		s.records[r.Key] = rec
		s.bytes += recordCost
		heap.Push(&s.byExpiry, rec)
	case rec.completed:
		return store.Result{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome}, nil
	case now.Before(rec.leaseEnd) || rec.fingerprint != r.Fingerprint:
		return store.Result{State: store.InProgress, Fingerprint: rec.fingerprint, RetryAfter: max(rec.leaseEnd.Sub(now), 0)}, nil
	default:
		// The lease has ended: its holder is presumed dead.
		s.lastToken++
		rec.token = s.lastToken
		rec.leaseEnd = now.Add(max(r.Lease, 0))
		heap.Fix(&s.byExpiry, rec.index)
	}
	return store.Result{State: store.Acquired, Token: rec.token}, nil
}

// Find implements store.Finder.
func (s *Store) Find(ctx context.Context, key store.Key) (store.Result, bool, error) {
	if err := ctx.Err(); err != nil {
		return store.Result{}, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.records[key]
	if !ok || !rec.completed || !s.now().Before(rec.removableAt()) {
		return store.Result{}, false, nil
	}
	return store.Result{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome}, true, nil
}

// Complete implements store.Store.
func (s *Store) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	rec, err := s.heldLocked(key, token, now)
	if err != nil {
		return err
	}
	if extra := cost(outcome) - recordCost; extra > 0 && !s.roomLocked(now, 0, extra) {
		return fmt.Errorf("memory store: complete: %w: an outcome of %d bytes, with %d of %d bytes counted", store.ErrFull, len(outcome), s.bytes, s.maxBytes)
	}
	s.bytes += cost(outcome) - recordCost
	rec.completed = true
	rec.outcome = outcome
	heap.Fix(&s.byExpiry, rec.index)
	return nil
}

// Release implements store.Store.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, err := s.heldLocked(key, token, s.now())
	if err != nil {
		return err
	}
	s.deleteLocked(rec)
	return nil
}

// Sweep implements store.Sweeper. It takes the lock once per batch.
func (s *Store) Sweep(ctx context.Context, batchSize int) (int, error) {
	if batchSize < 1 {
		batchSize = store.DefaultSweepBatch
	}
	now := s.now()
	deleted := 0
	for {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		s.mu.Lock()
		n := s.evictLocked(now, batchSize)
		s.mu.Unlock()
		deleted += n
		if n < batchSize {
			return deleted, nil
		}
	}
}

// Len returns the number of records held, expired ones included.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.records)
}

func (s *Store) heldLocked(key store.Key, token store.Token, now time.Time) (*record, error) {
	rec, ok := s.records[key]
	if !ok || rec.token != token || rec.completed || !now.Before(rec.removableAt()) {
		return nil, fmt.Errorf("memory store: token %d: %w", token, store.ErrLeaseLost)
	}
	return rec, nil
}

// evictLocked deletes up to limit records expired at now and returns how many.
func (s *Store) evictLocked(now time.Time, limit int) int {
	n := 0
	for n < limit && len(s.byExpiry) > 0 && !now.Before(s.byExpiry[0].removableAt()) {
		s.deleteLocked(s.byExpiry[0])
		n++
	}
	return n
}

func (s *Store) deleteLocked(rec *record) {
	heap.Remove(&s.byExpiry, rec.index)
	delete(s.records, rec.key)
	s.bytes -= cost(rec.outcome)
}

// expiryHeap orders records by removableAt; it implements heap.Interface.
type expiryHeap []*record

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].removableAt().Before(h[j].removableAt()) }
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *expiryHeap) Push(x any) {
	rec := x.(*record)
	rec.index = len(*h)
	*h = append(*h, rec)
}
func (h *expiryHeap) Pop() any {
	old := *h
	rec := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return rec
}
