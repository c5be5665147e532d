// Package memory is an in-process idemkey store, for tests and for services
// that run as a single process and accept that a restart forgets every key.
//
// It is safe for concurrent use: its records are split into 64 shards by
// key, each with its own lock, and a replay takes only its shard's read
// lock. Every Reserve deletes a few expired records, and Sweep deletes the
// rest on demand, so no goroutine runs in the background. It tells a
// duplicate that waits for a key (store.Watcher) the moment the key's record
// is completed or released. It records the steps of a run (store.Stepper),
// each within the bounds below as a record with its result as the outcome,
// and renews a live run's lease (store.Renewer).
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
// run). Replays of recorded keys go on working. The bounds are the whole
// store's, across its shards; two new keys that race for the last room may
// both be refused. A reservation without a
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
	"sync/atomic"
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

// evictPerReserve is how many expired records each Reserve deletes in its
// key's shard, and a new key in one more; more than one, so that deletion
// outpaces insertion in every shard and memory stays bounded.
const evictPerReserve = 2

// numShards is how many parts the records are split into, each with its
// own lock, map and expiry heap, so that calls on different keys seldom wait
// for each other. A key's shard is its first byte: the Key is a SHA-256.
const numShards = 64

// Store is an in-memory store.Store.
type Store struct {
	now func() time.Time

	maxRecords int64
	maxBytes   int64
	// What one partition other than the zero one may hold: share of
	// maxRecords and of maxBytes.
	partRecords int64
	partBytes   int64

	// The bounds are the whole store's, counted without a lock (take).
	total  usage
	parts  sync.Map // store.Partition -> *usage, of each partition holding records, but the zero one
	shards [numShards]shard
}

// A shard's records are read (a replay, a duplicate held) under mu's read
// lock, and changed under its write lock.
type shard struct {
	mu        sync.RWMutex
	records   map[store.Key]*record
	byExpiry  expiryHeap  // every record, soonest removable first
	lastToken store.Token // a token is unique per key, and a key keeps its shard
	// Keys held by a call, that duplicates wait for (Watch), under waitMu.
	// Watch and wake hold mu too, so no change falls between a Watch's
	// read of the record and its wait.
	waitMu  sync.Mutex
	waiting waitset.Set
	// The steps' records of each key (store.Stepper), made on its first
	// step; each lives till it expires, whatever becomes of the key's record.
	steps         map[store.Key][]*step
	stepsByExpiry stepHeap
	_             [64]byte // keeps the next shard's locks off this one's cache line
}

// usage is what records hold: how many, and how many bytes they count. A
// partition's records is -1 once it is let go (give).
type usage struct {
	records atomic.Int64
	bytes   atomic.Int64
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
	index       int // position in shard.byExpiry
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
	s := &Store{
		now:         o.now,
		maxRecords:  int64(o.maxRecords),
		maxBytes:    o.maxBytes,
		partRecords: max(int64(o.share*float64(o.maxRecords)), 1),
		partBytes:   max(int64(o.share*float64(o.maxBytes)), recordCost),
	}
	epoch := s.now()
	for i := range s.shards {
		s.shards[i].records = make(map[store.Key]*record)
		s.shards[i].byExpiry.epoch = epoch
	}
	return s
}

func (s *Store) shard(key store.Key) *shard { return &s.shards[key[0]%numShards] }

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

// take counts n more records and bytes more bytes for p and returns "", if
// neither p's share nor the store's bounds would pass; else it counts nothing
// and says which bound. Each count is added by compare-and-swap, so no bound
// is ever passed; two calls that race for the last room may both be refused
// where one alone would have had it.
func (s *Store) take(p store.Partition, n, bytes int64) string {
	if p != (store.Partition{}) {
		if full := s.takePart(p, n, bytes); full != "" {
			return full
		}
	}
	if add(&s.total.records, n, s.maxRecords) {
		if add(&s.total.bytes, bytes, s.maxBytes) {
			return ""
		}
		s.total.records.Add(-n)
	}
	if p != (store.Partition{}) {
		s.give(p, n, bytes)
	}
	return fmt.Sprintf("%d of %d records, %d of %d bytes counted", s.total.records.Load(), s.maxRecords, s.total.bytes.Load(), s.maxBytes)
}

func (s *Store) takePart(p store.Partition, n, bytes int64) string {
	for {
		v, ok := s.parts.Load(p)
		if !ok {
			v, _ = s.parts.LoadOrStore(p, new(usage))
		}
		u := v.(*usage)
		if n > 0 { // else the record counted already holds u
			old := u.records.Load()
			if old < 0 { // let go: replace it
				s.parts.CompareAndSwap(p, u, new(usage))
				continue
			}
			if old+n > s.partRecords {
				return fmt.Sprintf("the tenant's share is used: %d of %d records, %d of %d bytes counted", old, s.partRecords, u.bytes.Load(), s.partBytes)
			}
			if !u.records.CompareAndSwap(old, old+n) {
				continue
			}
		}
		if add(&u.bytes, bytes, s.partBytes) {
			return ""
		}
		s.give(p, n, 0)
		return fmt.Sprintf("the tenant's share is used: %d of %d records, %d of %d bytes counted", u.records.Load(), s.partRecords, u.bytes.Load(), s.partBytes)
	}
}

// add adds n to c unless that passes limit, and says whether it did.
func add(c *atomic.Int64, n, limit int64) bool {
	for {
		old := c.Load()
		if n > 0 && old+n > limit {
			return false
		}
		if c.CompareAndSwap(old, old+n) {
			return true
		}
	}
}

// give uncounts n records and bytes bytes of partition p, which take counted.
// A partition left with no record is let go.
func (s *Store) give(p store.Partition, n, bytes int64) {
	if p == (store.Partition{}) {
		return
	}
	v, _ := s.parts.Load(p)
	u := v.(*usage)
	u.bytes.Add(-bytes)
	if n != 0 && u.records.Add(-n) == 0 && u.records.CompareAndSwap(0, -1) {
		s.parts.CompareAndDelete(p, u)
	}
}

// resize makes a record of partition p that counts *counted bytes count c,
// if p and the store have room for the difference; else it says which bound
// that would pass.
func (s *Store) resize(p store.Partition, counted *int64, c int64) string {
	if grow := c - *counted; grow > 0 {
		if full := s.take(p, 0, grow); full != "" {
			return full
		}
	} else {
		s.give(p, 0, -grow)
		s.total.bytes.Add(grow)
	}
	*counted = c
	return ""
}

var (
	_ store.Store   = (*Store)(nil)
	_ store.Finder  = (*Store)(nil)
	_ store.Sweeper = (*Store)(nil)
	_ store.Watcher = (*Store)(nil)
	_ store.Stepper = (*Store)(nil)
	_ store.Renewer = (*Store)(nil)
)

// Reserve implements store.Store.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	if err := ctx.Err(); err != nil {
		return store.Entry{}, err
	}
	sh, now := s.shard(r.Key), s.now()
	res, ok, found := s.answer(sh, r, now)
	if ok {
		return res, nil
	}
	var fresh *record
	if !found { // made before the lock, so that a GC assist does not hold the shard up
		fresh = &record{key: r.Key, partition: r.Partition, fingerprint: r.Fingerprint}
	}
	for evicted := false; ; evicted = true {
		res, c, full := s.reserve(sh, r, fresh, now)
		if full == "" {
			return res, nil
		}
		if evicted {
			return store.Entry{}, fmt.Errorf("memory store: reserve: %w: no room for a record of %d bytes: %s", store.ErrFull, c, full)
		}
		s.evictAll()
		now = s.now()
	}
}

// answer decides r under sh's read lock if Reserve would change nothing: its
// record is completed or held, and sh holds no expired record to delete.
// Else it says whether r.Key has a record.
func (s *Store) answer(sh *shard, r store.Reservation, now time.Time) (res store.Entry, ok, found bool) {
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	rec, ok := sh.records[r.Key]
	if !ok || sh.byExpiry.due(now) {
		return store.Entry{}, false, ok
	}
	switch {
	case rec.completed:
		return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome, Expires: rec.expiresAt}, true, true
	case now.Before(rec.leaseEnd) || rec.fingerprint != r.Fingerprint:
		return store.Entry{State: store.Held, Fingerprint: rec.fingerprint, RetryAfter: max(rec.leaseEnd.Sub(now), 0), Expires: rec.expiresAt}, true, true
	}
	return store.Entry{}, false, true
}

// reserve decides r at now in its shard sh as Reserve does, with fresh, if
// not nil, as a new record of r.Key; if there is no room for a record of c
// bytes, it says which bound that would pass.
func (s *Store) reserve(sh *shard, r store.Reservation, fresh *record, now time.Time) (res store.Entry, c int64, full string) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	s.evictLocked(sh, now, evictPerReserve)

	rec, ok := sh.records[r.Key]
	if ok && !now.Before(rec.removableAt()) {
		s.deleteLocked(sh, rec)
		ok = false
	}
	switch {
	case !ok:
		// A new record is let in only with as many expired ones deleted in
		// a shard chosen by the key's next byte, if it is not busy, so that
		// no shard keeps its expired records for want of new keys of its own.
		if o := &s.shards[r.Key[1]%numShards]; o != sh && o.mu.TryLock() {
			s.evictLocked(o, now, evictPerReserve)
			o.mu.Unlock()
		}
		c = s.reservedCost(r)
		if full := s.take(r.Partition, 1, c); full != "" {
			return store.Entry{}, c, full
		}
		sh.lastToken++
		if rec = fresh; rec == nil {
			rec = &record{key: r.Key, partition: r.Partition, fingerprint: r.Fingerprint}
		}
		rec.token = sh.lastToken
		rec.cost = c
		rec.leaseEnd = now.Add(max(r.Lease, 0))
		rec.expiresAt = now.Add(max(r.Retention, 0))
		sh.records[r.Key] = rec
		heap.Push(&sh.byExpiry, rec)
	case rec.completed:
		return store.Entry{State: store.Completed, Fingerprint: rec.fingerprint, Outcome: rec.outcome, Expires: rec.expiresAt}, 0, ""
	case now.Before(rec.leaseEnd) || rec.fingerprint != r.Fingerprint:
		return store.Entry{State: store.Held, Fingerprint: rec.fingerprint, RetryAfter: max(rec.leaseEnd.Sub(now), 0), Expires: rec.expiresAt}, 0, ""
	default:
		// The lease has ended: its holder is presumed dead. The new holder
		// needs room for its own largest outcome; what the old one set aside
		// stays set aside.
		if c = s.reservedCost(r); c > rec.cost {
			if full := s.resize(rec.partition, &rec.cost, c); full != "" {
				return store.Entry{}, c, full
			}
		}
		sh.lastToken++
		rec.token = sh.lastToken
		rec.leaseEnd = now.Add(max(r.Lease, 0))
		sh.byExpiry.fix(rec)
	}
	return store.Entry{State: store.Acquired, Token: rec.token, Expires: rec.expiresAt}, c, ""
}

// Find implements store.Finder.
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	if err := ctx.Err(); err != nil {
		return store.Entry{}, false, err
	}
	sh := s.shard(key)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	rec, ok := sh.records[key]
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
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for evicted := false; ; evicted = true {
		rec, err := s.heldLocked(sh, key, token, s.now())
		if err != nil {
			return err
		}
		full := s.resize(rec.partition, &rec.cost, cost(outcome))
		if full == "" {
			rec.completed = true
			rec.outcome = outcome
			sh.byExpiry.fix(rec)
			sh.wake(key)
			return nil
		}
		if evicted {
			return fmt.Errorf("memory store: complete: %w: no room for an outcome of %d bytes: %s", store.ErrFull, len(outcome), full)
		}
		sh.mu.Unlock() // evictAll takes every shard's lock in turn
		s.evictAll()
		sh.mu.Lock()
	}
}

// Watch implements store.Watcher: Complete, Release and the deletion of an
// expired record close the channel of the key's duplicates.
func (s *Store) Watch(key store.Key) (changed <-chan struct{}, stop func()) {
	sh := s.shard(key)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	rec, ok := sh.records[key]
	if !ok || rec.completed || !s.now().Before(rec.leaseEnd) {
		return waitset.Closed, func() {}
	}
	sh.waitMu.Lock()
	defer sh.waitMu.Unlock()
	return sh.waiting.Watch(key, &sh.waitMu)
}

// wake wakes the duplicates waiting for key, whose record changed; sh.mu is
// held.
func (sh *shard) wake(key store.Key) {
	sh.waitMu.Lock()
	sh.waiting.Wake(key)
	sh.waitMu.Unlock()
}

// Release implements store.Store.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	rec, err := s.heldLocked(sh, key, token, s.now())
	if err != nil {
		return err
	}
	s.deleteLocked(sh, rec)
	return nil
}

// Renew implements store.Renewer.
func (s *Store) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, now := s.shard(key), s.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	rec, err := s.heldLocked(sh, key, token, now)
	if err != nil {
		return err
	}
	rec.leaseEnd = now.Add(max(lease, 0))
	sh.byExpiry.fix(rec)
	return nil
}

// Sweep implements store.Sweeper: it deletes expired records and steps'
// records. It takes a shard's lock once per batch.
func (s *Store) Sweep(ctx context.Context, batchSize int) (int, error) {
	if batchSize < 1 {
		batchSize = store.DefaultSweepBatch
	}
	now := s.now()
	deleted := 0
	for i := range s.shards {
		sh := &s.shards[i]
		for n := batchSize; n == batchSize; {
			if err := ctx.Err(); err != nil {
				return deleted, err
			}
			sh.mu.Lock()
			n = s.evictLocked(sh, now, batchSize)
			sh.mu.Unlock()
			deleted += n
		}
	}
	return deleted, nil
}

// Len returns the number of records held, steps' records and expired ones
// included.
func (s *Store) Len() int { return int(s.total.records.Load()) }

// Bytes returns the bytes the records count against WithMaxBytes, expired
// ones included, with the room set aside for the outcomes of calls that
// still run.
func (s *Store) Bytes() int64 { return s.total.bytes.Load() }

func (s *Store) heldLocked(sh *shard, key store.Key, token store.Token, now time.Time) (*record, error) {
	rec, ok := sh.records[key]
	if !ok || rec.token != token || rec.completed || !now.Before(rec.removableAt()) {
		return nil, fmt.Errorf("memory store: token %d: %w", token, store.ErrLeaseLost)
	}
	return rec, nil
}

// evictAll deletes every expired record, shard by shard: the room a bound
// needs goes to live records first.
func (s *Store) evictAll() {
	now := s.now()
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		s.evictLocked(sh, now, len(sh.byExpiry.e)+len(sh.stepsByExpiry))
		sh.mu.Unlock()
	}
}

// evictLocked deletes up to limit records and steps' records of sh expired
// at now and returns how many.
func (s *Store) evictLocked(sh *shard, now time.Time, limit int) int {
	n := 0
	for ; n < limit; n++ {
		switch {
		case sh.byExpiry.due(now):
			s.deleteLocked(sh, sh.byExpiry.e[0].rec)
		case sh.stepsByExpiry.due(now):
			s.deleteStepLocked(sh, sh.stepsByExpiry[0])
		default:
			return n
		}
	}
	return n
}

func (s *Store) deleteLocked(sh *shard, rec *record) {
	heap.Remove(&sh.byExpiry, rec.index)
	delete(sh.records, rec.key)
	s.give(rec.partition, 1, rec.cost)
	s.total.records.Add(-1)
	s.total.bytes.Add(-rec.cost)
	sh.wake(rec.key)
}

// expiryHeap orders records by removableAt, which each entry holds, so
// that reading the soonest does not reach into a record; it implements
// heap.Interface.
type expiryHeap struct {
	epoch time.Time // what each at counts from
	e     []expiry
}

type expiry struct {
	at  time.Duration // rec.removableAt(), from epoch
	rec *record
}

// due says whether the soonest record is removable at now.
func (h *expiryHeap) due(now time.Time) bool {
	return len(h.e) > 0 && now.Sub(h.epoch) >= h.e[0].at
}

// fix moves rec to its place after its removableAt changed.
func (h *expiryHeap) fix(rec *record) {
	h.e[rec.index].at = rec.removableAt().Sub(h.epoch)
	heap.Fix(h, rec.index)
}

func (h *expiryHeap) Len() int           { return len(h.e) }
func (h *expiryHeap) Less(i, j int) bool { return h.e[i].at < h.e[j].at }
func (h *expiryHeap) Swap(i, j int) {
	h.e[i], h.e[j] = h.e[j], h.e[i]
	h.e[i].rec.index = i
	h.e[j].rec.index = j
}
func (h *expiryHeap) Push(x any) {
	rec := x.(*record)
	rec.index = len(h.e)
	h.e = append(h.e, expiry{rec.removableAt().Sub(h.epoch), rec})
}
func (h *expiryHeap) Pop() any {
	rec := h.e[len(h.e)-1].rec
	h.e[len(h.e)-1] = expiry{}
	h.e = h.e[:len(h.e)-1]
	return rec
}
