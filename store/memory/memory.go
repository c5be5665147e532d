// Package memory is an in-process idemkey store, for tests and for services
// that run as a single process and accept that a restart forgets every key.
//
// It is safe for concurrent use. Every Reserve deletes a few expired records,
// and Sweep deletes the rest on demand, so no goroutine runs in the
// background. It tells a duplicate that waits for a key (store.Watcher) the
// moment the key's record is completed or released.
//
// # Bounds
//
// The store holds at most WithMaxRecords records (DefaultMaxRecords) and
// WithMaxBytes bytes (DefaultMaxBytes). A completed record counts recordCost
// bytes plus what its outcome holds beyond store.SmallOutcome. A record whose
// call still runs counts the most its outcome may take instead
// (store.Reservation.MaxOutcome: the engine's WithMaxRecordSize, 4 MiB by
// default): a new key is let in only if its largest possible reply fits, so
// every call that runs records its real reply, and the calls there is no room
// for are refused before they run. Completing frees what the reply did not
// take; releasing frees it all.
//
// That room bounds the calls in flight. With the defaults, a store of 64 MiB
// runs at most 15 new keys at once, 7 of them of one tenant; a service whose
// replies are small says so with the engine's WithMaxRecordSize, and runs
// more: with 64 KiB, about a thousand, 500 of one tenant. A MaxOutcome of
// more than a tenant may hold sets aside all it may hold, so such a call runs
// only while its tenant holds nothing else.
//
// At a bound, expired records go first; if there is still no room, Reserve of
// a new key returns store.ErrFull (the engine answers StoreFull: over gRPC
// ResourceExhausted, reason IDEMPOTENCY_STORE_FULL; the handler does not
// run). Replays of recorded keys go on working. A reservation without a
// MaxOutcome (0) sets room aside for store.SmallOutcome bytes only; Complete
// of a larger outcome with no room left then returns store.ErrFull (the
// engine records the entry point's short stand-in instead: over gRPC,
// Internal). Measured on a flood of unique keys and of large replies, the
// heap of a process stays within about three times WithMaxBytes above its
// size before (see TestFloodStaysBounded).
//
// # Tenants
//
// No tenant may hold more than WithTenantShare of either bound
// (DefaultTenantShare: half), so that one tenant that floods the store with
// new keys, or with calls that hang, leaves the rest to the others rather
// than lock them out until its records expire. The store knows a tenant only
// by its store.TenantPartition, never by name. Calls without a tenant (a
// service without tenants) are bounded by the whole store alone. With many
// tenants a smaller share keeps more of them in: two tenants at half each can
// still fill the store.
package memory

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemkey/idemkey/internal/waitset"
	"github.com/idemkey/idemkey/store"
)

// Defaults for the store's bounds, each changed by the option that names it.
// Together they keep a store on a laptop under about 100 MB of heap.
const (
	DefaultMaxRecords  = 100_000  // WithMaxRecords
	DefaultMaxBytes    = 64 << 20 // WithMaxBytes
	DefaultTenantShare = 0.5      // WithTenantShare
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
	share      float64
	// What one partition other than the zero one may hold: share of
	// maxRecords and of maxBytes.
	partRecords int
	partBytes   int64

	mu        sync.Mutex
	records   map[store.Key]*record
	byExpiry  expiryHeap // every record, soonest removable first
	total     usage
	parts     map[store.Partition]*usage // of each partition holding records, but the zero one
	lastToken store.Token
	waiting   waitset.Set // keys held by a call, that duplicates wait for (Watch)
}

// usage is what records hold: how many, and how many bytes they count.
type usage struct {
	records int
	bytes   int64
}

type record struct {
	key         store.Key
	partition   store.Partition
	fingerprint store.Fingerprint
	token       store.Token
	completed   bool
	outcome     []byte
	cost        int64 // what the record counts against the byte bounds
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
type Option func(*options)

// options are New's settings, before New clamps them.
type options struct {
	now        func() time.Time
	maxRecords int
	maxBytes   int64
	share      float64
}

// defaultOptions are copied by every New before its options apply, so that
// no Option can change another store's defaults.
var defaultOptions = options{
	now:        time.Now,
	maxRecords: DefaultMaxRecords,
	maxBytes:   DefaultMaxBytes,
	share:      DefaultTenantShare,
}

// WithClock makes the store read the time from now instead of time.Now, so
// tests can move time forward without sleeping. A nil now keeps time.Now.
func WithClock(now func() time.Time) Option {
	return func(o *options) { o.now = now }
}

// WithMaxRecords bounds the number of records, expired ones included until
// they are deleted (DefaultMaxRecords if n < 1).
func WithMaxRecords(n int) Option {
	return func(o *options) { o.maxRecords = n }
}

// WithMaxBytes bounds the bytes the records count (DefaultMaxBytes if n < 1):
// recordCost each, plus what each outcome holds beyond store.SmallOutcome,
// or, while its call runs, may hold (store.Reservation.MaxOutcome). A bound
// below what one record needs is raised to that.
func WithMaxBytes(n int64) Option {
	return func(o *options) { o.maxBytes = n }
}

// WithTenantShare bounds what the records of one tenant may hold, as a
// fraction of WithMaxRecords and of WithMaxBytes (DefaultTenantShare). 1
// lets one tenant take the whole store; a fraction above 1 counts as 1, and
// one of 0 or less keeps the default. A tenant may always hold at least one
// record. Calls without a tenant are bounded by the whole store alone.
func WithTenantShare(fraction float64) Option {
	return func(o *options) { o.share = fraction }
}

// newOptions copies the defaults, applies opts, and clamps each setting
// into its range.
func newOptions(opts []Option) options {
	o := defaultOptions
	for _, opt := range opts {
		opt(&o)
	}
	if o.now == nil {
		o.now = time.Now
	}
	if o.maxRecords < 1 {
		o.maxRecords = DefaultMaxRecords
	}
	if o.maxBytes < 1 {
		o.maxBytes = DefaultMaxBytes
	}
	o.maxBytes = max(o.maxBytes, recordCost)
	if !(o.share > 0) { // NaN too
		o.share = DefaultTenantShare
	}
	o.share = min(o.share, 1)
	return o
}

// New returns an empty store. Unlike postgres.New and redis.New it returns
// no error: every option clamps a value out of its range (see each) rather
// than refuse it, so there is nothing to report, and the memory store's
// New is called bare in hundreds of tests and examples, which an error
// would make two lines each.
func New(opts ...Option) *Store {
	o := newOptions(opts)
	return &Store{
		now:         o.now,
		maxRecords:  o.maxRecords,
		maxBytes:    o.maxBytes,
		share:       o.share,
		partRecords: max(int(o.share*float64(o.maxRecords)), 1),
		partBytes:   max(int64(o.share*float64(o.maxBytes)), recordCost),
		records:     make(map[store.Key]*record),
		parts:       make(map[store.Partition]*usage),
	}
}

// cost is what a completed record with outcome counts against the byte bounds.
func cost(outcome []byte) int64 {
	return recordCost + int64(max(len(outcome)-store.SmallOutcome, 0))
}

// reservedCost is what a record counts while its call runs: room for an
// outcome of r.MaxOutcome bytes, or, if the partition could never hold that
// much, all it may hold.
func (s *Store) reservedCost(r store.Reservation) int64 {
	c := recordCost + int64(max(r.MaxOutcome-store.SmallOutcome, 0))
	if r.Partition == (store.Partition{}) {
		return min(c, s.maxBytes)
	}
	return min(c, s.partBytes)
}

// fullLocked says which bound records of p would pass with records more
// records and bytes more bytes; "" if none.
func (s *Store) fullLocked(p store.Partition, records int, bytes int64) string {
	if s.total.records+records > s.maxRecords || s.total.bytes+bytes > s.maxBytes {
		return fmt.Sprintf("%d of %d records, %d of %d bytes counted", s.total.records, s.maxRecords, s.total.bytes, s.maxBytes)
	}
	if p == (store.Partition{}) {
		return ""
	}
	var u usage
	if pu := s.parts[p]; pu != nil {
		u = *pu
	}
	if u.records+records > s.partRecords || u.bytes+bytes > s.partBytes {
		return fmt.Sprintf("the tenant's share is used: %d of %d records, %d of %d bytes counted", u.records, s.partRecords, u.bytes, s.partBytes)
	}
	return ""
}

// roomLocked returns "" if p has room for records more records and bytes
// more bytes, after deleting every expired record if it did not; else which
// bound they would pass.
func (s *Store) roomLocked(now time.Time, p store.Partition, records int, bytes int64) string {
	if full := s.fullLocked(p, records, bytes); full == "" {
		return ""
	}
	s.evictLocked(now, len(s.byExpiry))
	return s.fullLocked(p, records, bytes)
}

// countLocked adds records records and bytes bytes to what p holds.
func (s *Store) countLocked(p store.Partition, records int, bytes int64) {
	s.total.records += records
	s.total.bytes += bytes
	if p == (store.Partition{}) {
		return
	}
	u := s.parts[p]
	if u == nil {
		u = &usage{}
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
func (s *Store) resizeLocked(now time.Time, rec *record, c int64) string {
	if grow := c - rec.cost; grow > 0 {
		if full := s.roomLocked(now, rec.partition, 0, grow); full != "" {
			return full
		}
	}
	s.countLocked(rec.partition, 0, c-rec.cost)
	rec.cost = c
	return ""
}

var (
	_ store.Store   = (*Store)(nil)
	_ store.Finder  = (*Store)(nil)
	_ store.Sweeper = (*Store)(nil)
	_ store.Watcher = (*Store)(nil)
)

// Reserve implements store.Store.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
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
			return store.Entry{}, fmt.Errorf("memory store: reserve: %w: no room for a record of %d bytes: %s", store.ErrFull, c, full)
		}
		s.lastToken++
		rec = &record{
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
				return store.Entry{}, fmt.Errorf("memory store: reserve: %w: no room for a record of %d bytes: %s", store.ErrFull, c, full)
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
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
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
// expired record close the channel of the key's duplicates.
func (s *Store) Watch(key store.Key) (changed <-chan struct{}, stop func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.records[key]
	if !ok || rec.completed || !s.now().Before(rec.leaseEnd) {
		return waitset.Closed, func() {}
	}
	return s.waiting.Watch(key, &s.mu)
}

// wakeLocked wakes the duplicates waiting for key, whose record changed.
func (s *Store) wakeLocked(key store.Key) { s.waiting.Wake(key) }

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

// Bytes returns the bytes the records count against WithMaxBytes, expired
// ones included, with the room set aside for the outcomes of calls that
// still run.
func (s *Store) Bytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total.bytes
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
	s.countLocked(rec.partition, -1, -rec.cost)
	s.wakeLocked(rec.key)
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
