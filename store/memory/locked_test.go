package memory

// The store as it was before its records were split into shards: one lock
// for everything. BenchmarkVsLocked runs it beside Store, as the baseline.

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemkey/idemkey/internal/waitset"
	"github.com/idemkey/idemkey/store"
)

// NewLocked returns the store as it was before its shards.
func NewLocked(opts ...Option) store.Store {
	o := newOptions(opts)
	return &lockedStore{
		now:         o.now,
		maxRecords:  o.maxRecords,
		maxBytes:    o.maxBytes,
		share:       o.share,
		partRecords: max(int(o.share*float64(o.maxRecords)), 1),
		partBytes:   max(int64(o.share*float64(o.maxBytes)), recordCost),
		records:     make(map[store.Key]*lockedRecord),
		parts:       make(map[store.Partition]*lockedUsage),
	}
}

// lockedStore is an in-memory store.Store.
type lockedStore struct {
	now func() time.Time

	maxRecords int
	maxBytes   int64
	share      float64
	// What one partition other than the zero one may hold: share of
	// maxRecords and of maxBytes.
	partRecords int
	partBytes   int64

	mu        sync.Mutex
	records   map[store.Key]*lockedRecord
	byExpiry  lockedHeap // every lockedRecord, soonest removable first
	total     lockedUsage
	parts     map[store.Partition]*lockedUsage // of each partition holding records, but the zero one
	lastToken store.Token
	waiting   waitset.Set // keys held by a call, that duplicates wait for (Watch)
}

// lockedUsage is what records hold: how many, and how many bytes they count.
type lockedUsage struct {
	records int
	bytes   int64
}

type lockedRecord struct {
	key         store.Key
	partition   store.Partition
	fingerprint store.Fingerprint
	token       store.Token
	completed   bool
	outcome     []byte
	cost        int64 // what the lockedRecord counts against the byte bounds
	leaseEnd    time.Time
	expiresAt   time.Time
	index       int // position in Store.byExpiry
}

// removableAt is when the lockedRecord becomes expired: its retention has passed and
// it holds no live lease.
func (r *lockedRecord) removableAt() time.Time {
	if !r.completed && r.leaseEnd.After(r.expiresAt) {
		return r.leaseEnd
	}
	return r.expiresAt
}

// reservedCost is what a lockedRecord counts while its call runs: room for an
// outcome of r.MaxOutcome bytes, or, if the partition could never hold that
// much, all it may hold.
func (s *lockedStore) reservedCost(r store.Reservation) int64 {
	c := recordCost + int64(max(r.MaxOutcome-store.SmallOutcome, 0))
	if r.Partition == (store.Partition{}) {
		return min(c, s.maxBytes)
	}
	return min(c, s.partBytes)
}

// fullLocked says which bound records of p would pass with records more
// records and bytes more bytes; "" if none.
func (s *lockedStore) fullLocked(p store.Partition, records int, bytes int64) string {
	if s.total.records+records > s.maxRecords || s.total.bytes+bytes > s.maxBytes {
		return fmt.Sprintf("%d of %d records, %d of %d bytes counted", s.total.records, s.maxRecords, s.total.bytes, s.maxBytes)
	}
	if p == (store.Partition{}) {
		return ""
	}
	var u lockedUsage
	if pu := s.parts[p]; pu != nil {
		u = *pu
	}
	if u.records+records > s.partRecords || u.bytes+bytes > s.partBytes {
		return fmt.Sprintf("the tenant's share is used: %d of %d records, %d of %d bytes counted", u.records, s.partRecords, u.bytes, s.partBytes)
	}
	return ""
}

// roomLocked returns "" if p has room for records more records and bytes
// more bytes, after deleting every expired lockedRecord if it did not; else which
// bound they would pass.
func (s *lockedStore) roomLocked(now time.Time, p store.Partition, records int, bytes int64) string {
	if full := s.fullLocked(p, records, bytes); full == "" {
		return ""
	}
	s.evictLocked(now, len(s.byExpiry))
	return s.fullLocked(p, records, bytes)
}

// countLocked adds records records and bytes bytes to what p holds.
func (s *lockedStore) countLocked(p store.Partition, records int, bytes int64) {
	s.total.records += records
	s.total.bytes += bytes
	if p == (store.Partition{}) {
		return
	}
	u := s.parts[p]
	if u == nil {
		u = &lockedUsage{}
		s.parts[p] = u
	}
	u.records += records
	u.bytes += bytes
	if u.records == 0 {
		delete(s.parts, p)
	}
}

// resizeLocked makes rec count c bytes, if its partition and the store have
// room for the difference; else it says which bound that would pass.
func (s *lockedStore) resizeLocked(now time.Time, rec *lockedRecord, c int64) string {
	if grow := c - rec.cost; grow > 0 {
		if full := s.roomLocked(now, rec.partition, 0, grow); full != "" {
			return full
		}
	}
	s.countLocked(rec.partition, 0, c-rec.cost)
	rec.cost = c
	return ""
}

// Reserve implements store.Store.
func (s *lockedStore) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	if err := ctx.Err(); err != nil {
		return store.Entry{}, err
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
		c := s.reservedCost(r)
		if full := s.roomLocked(now, r.Partition, 1, c); full != "" {
			return store.Entry{}, fmt.Errorf("memory store: reserve: %w: no room for a lockedRecord of %d bytes: %s", store.ErrFull, c, full)
		}
		s.lastToken++
		rec = &lockedRecord{
			key:         r.Key,
			partition:   r.Partition,
			fingerprint: r.Fingerprint,
			token:       s.lastToken,
			cost:        c,
			leaseEnd:    now.Add(max(r.Lease, 0)),
			expiresAt:   now.Add(max(r.Retention, 0)),
		}
		s.records[r.Key] = rec
		s.countLocked(rec.partition, 1, c)
		heap.Push(&s.byExpiry, rec)
	case rec.completed:
		return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome, Expires: rec.expiresAt}, nil
	case now.Before(rec.leaseEnd) || rec.fingerprint != r.Fingerprint:
		return store.Entry{State: store.Held, Fingerprint: rec.fingerprint, RetryAfter: max(rec.leaseEnd.Sub(now), 0), Expires: rec.expiresAt}, nil
	default:
		// The lease has ended: its holder is presumed dead. The new holder
		// needs room for its own largest outcome; what the old one set aside
		// stays set aside.
		if c := s.reservedCost(r); c > rec.cost {
			if full := s.resizeLocked(now, rec, c); full != "" {
				return store.Entry{}, fmt.Errorf("memory store: reserve: %w: no room for a lockedRecord of %d bytes: %s", store.ErrFull, c, full)
			}
		}
		s.lastToken++
		rec.token = s.lastToken
		rec.leaseEnd = now.Add(max(r.Lease, 0))
		heap.Fix(&s.byExpiry, rec.index)
	}
	return store.Entry{State: store.Acquired, Token: rec.token, Expires: rec.expiresAt}, nil
}

// Find implements store.Finder.
func (s *lockedStore) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	if err := ctx.Err(); err != nil {
		return store.Entry{}, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.records[key]
	if !ok || !rec.completed || !s.now().Before(rec.removableAt()) {
		return store.Entry{}, false, nil
	}
	return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome, Expires: rec.expiresAt}, true, nil
}

// Complete implements store.Store.
func (s *lockedStore) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
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
	if full := s.resizeLocked(now, rec, cost(outcome)); full != "" {
		return fmt.Errorf("memory store: complete: %w: no room for an outcome of %d bytes: %s", store.ErrFull, len(outcome), full)
	}
	rec.completed = true
	rec.outcome = outcome
	heap.Fix(&s.byExpiry, rec.index)
	s.wakeLocked(key)
	return nil
}

// Watch implements store.Watcher: Complete, Release and the deletion of an
// expired lockedRecord close the channel of the key's duplicates.
func (s *lockedStore) Watch(key store.Key) (changed <-chan struct{}, stop func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.records[key]
	if !ok || rec.completed || !s.now().Before(rec.leaseEnd) {
		return waitset.Closed, func() {}
	}
	return s.waiting.Watch(key, &s.mu)
}

// wakeLocked wakes the duplicates waiting for key, whose lockedRecord changed.
func (s *lockedStore) wakeLocked(key store.Key) { s.waiting.Wake(key) }

// Release implements store.Store.
func (s *lockedStore) Release(ctx context.Context, key store.Key, token store.Token) error {
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
func (s *lockedStore) Sweep(ctx context.Context, batchSize int) (int, error) {
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
func (s *lockedStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.records)
}

// Bytes returns the bytes the records count against WithMaxBytes, expired
// ones included, with the room set aside for the outcomes of calls that
// still run.
func (s *lockedStore) Bytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total.bytes
}

func (s *lockedStore) heldLocked(key store.Key, token store.Token, now time.Time) (*lockedRecord, error) {
	rec, ok := s.records[key]
	if !ok || rec.token != token || rec.completed || !now.Before(rec.removableAt()) {
		return nil, fmt.Errorf("memory store: token %d: %w", token, store.ErrLeaseLost)
	}
	return rec, nil
}

// evictLocked deletes up to limit records expired at now and returns how many.
func (s *lockedStore) evictLocked(now time.Time, limit int) int {
	n := 0
	for n < limit && len(s.byExpiry) > 0 && !now.Before(s.byExpiry[0].removableAt()) {
		s.deleteLocked(s.byExpiry[0])
		n++
	}
	return n
}

func (s *lockedStore) deleteLocked(rec *lockedRecord) {
	heap.Remove(&s.byExpiry, rec.index)
	delete(s.records, rec.key)
	s.countLocked(rec.partition, -1, -rec.cost)
	s.wakeLocked(rec.key)
}

// lockedHeap orders records by removableAt; it implements heap.Interface.
type lockedHeap []*lockedRecord

func (h lockedHeap) Len() int           { return len(h) }
func (h lockedHeap) Less(i, j int) bool { return h[i].removableAt().Before(h[j].removableAt()) }
func (h lockedHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *lockedHeap) Push(x any) {
	rec := x.(*lockedRecord)
	rec.index = len(*h)
	*h = append(*h, rec)
}
func (h *lockedHeap) Pop() any {
	old := *h
	rec := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return rec
}
