package main

import "time"

// state is a record's, as store.State names them for Reserve's answer.
type state uint8

const (
	absent    state = iota
	acquired        // store.Acquired
	completed       // store.Completed
	held            // store.Held
)

// version orders a record's writes for last-writer-wins: the virtual time
// of the write, then the region that wrote it, then that region's count.
type version struct {
	at     time.Duration
	region int
	seq    int64
}

func (v version) less(w version) bool {
	if v.at != w.at {
		return v.at < w.at
	}
	if v.region != w.region {
		return v.region < w.region
	}
	return v.seq < w.seq
}

// record is a key's record in one region's store, as store.Store describes
// it: held under a lease and a fencing token, or completed; a released one
// is kept as a tombstone (gone) so that replication can order it.
type record struct {
	fp        uint64
	token     int64
	completed bool
	gone      bool
	leaseEnd  time.Duration
	expires   time.Duration
	ver       version
}

// removableAt is when the record counts as absent: its retention has passed
// and it holds no live lease (store/memory's rule).
func (r *record) removableAt() time.Duration {
	if r.gone {
		return 0
	}
	if !r.completed && r.leaseEnd > r.expires {
		return r.leaseEnd
	}
	return r.expires
}

// entry is Reserve's answer (store.Entry, cut to what the simulation reads).
type entry struct {
	state      state
	token      int64
	retryAfter time.Duration
}

// regionStore models one region's store on the contract of store/store.go:
// Reserve decides in one step (absent or expired: acquired with a new
// token; completed; a live lease: held; an ended lease: acquired again by
// the same fingerprint, else held); Complete and Release are fenced by the
// token. The clock is the simulation's. TestModelIsMemory checks it against
// store/memory on the same clock.
type regionStore struct {
	region int
	recs   map[int]*record
	tokens *int64 // shared by every region, so that no token is handed out twice
	seq    int64
}

func newRegionStore(region int, tokens *int64) *regionStore {
	return &regionStore{region: region, recs: make(map[int]*record), tokens: tokens}
}

// reserve is store.Store.Reserve at now.
func (s *regionStore) reserve(key int, fp uint64, lease, retention, now time.Duration) entry {
	rec := s.recs[key]
	if rec != nil && now >= rec.removableAt() {
		rec = nil
	}
	switch {
	case rec == nil:
		*s.tokens++
		rec = &record{fp: fp, token: *s.tokens, leaseEnd: now + lease, expires: now + retention}
		s.recs[key] = rec
	case rec.completed:
		return entry{state: completed}
	case now < rec.leaseEnd || rec.fp != fp:
		return entry{state: held, retryAfter: max(rec.leaseEnd-now, 0)}
	default: // the lease has ended: its holder is presumed dead
		*s.tokens++
		rec.token = *s.tokens
		rec.leaseEnd = now + lease
	}
	s.stamp(rec, now)
	return entry{state: acquired, token: rec.token}
}

// complete is store.Store.Complete: false is store.ErrLeaseLost.
func (s *regionStore) complete(key int, token int64, now time.Duration) bool {
	return s.end(key, token, now, false)
}

// release is store.Store.Release: false is store.ErrLeaseLost.
func (s *regionStore) release(key int, token int64, now time.Duration) bool {
	return s.end(key, token, now, true)
}

// end completes or releases the record that token holds in progress.
func (s *regionStore) end(key int, token int64, now time.Duration, release bool) bool {
	rec := s.recs[key]
	if rec == nil || rec.gone || rec.token != token || rec.completed || now >= rec.removableAt() {
		return false
	}
	rec.completed, rec.gone = !release, release
	s.stamp(rec, now)
	return true
}

// find returns key's record if it counts at now (held or completed), else nil.
func (s *regionStore) find(key int, now time.Duration) *record {
	rec := s.recs[key]
	if rec == nil || now >= rec.removableAt() {
		return nil
	}
	return rec
}

func (s *regionStore) stamp(rec *record, now time.Duration) {
	s.seq++
	rec.ver = version{at: now, region: s.region, seq: s.seq}
}

// apply is replication's write: a copy of another region's record replaces
// this region's if it was written later (last writer wins), and reports
// whether it did.
func (s *regionStore) apply(key int, copied record) bool {
	if rec := s.recs[key]; rec != nil && !rec.ver.less(copied.ver) {
		return false
	}
	s.recs[key] = &copied
	return true
}
