package main

import (
	"container/heap"
	"math/rand/v2"
	"slices"
	"time"
)

// kind is a design's way of serving a key across regions.
type kind uint8

const (
	pinned kind = iota // the key's region serves it; the client goes nowhere else
	home               // the key names its home region; any region forwards to it
	lww                // every region serves from its own store, replicated asynchronously, last writer wins
	quorum             // one store whose every write waits for a majority of regions
	fence              // lww's replication, and a region refuses a key first sent elsewhere until its record arrives
)

// design is one row's way of serving keys.
type design struct {
	name string
	kind kind
	// bound, for fence: how long after the key's first-sent time a region
	// that has no record of it may run it anyway; 0 for never.
	bound time.Duration
}

// designs are the table's rows, in order.
var designs = []design{
	{name: "pinned", kind: pinned},
	{name: "home", kind: home},
	{name: "lww", kind: lww},
	{name: "quorum", kind: quorum},
	{name: "fence", kind: fence},
	{name: "fence 30s", kind: fence, bound: 30 * time.Second},
	{name: "fence 2s", kind: fence, bound: 2 * time.Second},
}

// replicates reports whether d replicates asynchronously: only then does
// the lag change its run.
func (d design) replicates() bool { return d.kind == lww || d.kind == fence }

// config is one run's world. The zero values of the network, client and
// server fields are filled by defaults.
type config struct {
	seed    uint64
	ops     int           // operations, each one key
	span    time.Duration // operations start uniformly over it
	lag     time.Duration // asynchronous replication's delay
	down    bool          // region c is down over [downAt, downAt+downFor)
	downAt  time.Duration
	downFor time.Duration

	near, far, inter time.Duration // one way: client to its nearest region, to another, region to region
	lease            time.Duration // the engine's: the call's deadline plus its 5 s grace
	retention        time.Duration
	maxRetryAfter    time.Duration // engine.DefaultMaxRetryAfter
	deadline         time.Duration // each attempt's, on the client
	maxAttempts      int
	budget           time.Duration // from the first attempt; past it the operation failed
	lossRate         float64       // share of replies lost after the server answered
	failoverRate     float64       // share of retries sent to another region
}

// defaults fills the zero fields of c.
func (c config) defaults() config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.ops == 0 {
		c.ops = 20000
	}
	def(&c.span, 10*time.Minute)
	def(&c.downAt, c.span/3)
	def(&c.downFor, 2*time.Minute)
	def(&c.near, 10*time.Millisecond)
	def(&c.far, 60*time.Millisecond)
	def(&c.inter, 60*time.Millisecond)
	def(&c.deadline, time.Second)
	def(&c.lease, c.deadline+5*time.Second)
	def(&c.retention, 24*time.Hour)
	def(&c.maxRetryAfter, time.Second)
	def(&c.budget, time.Minute)
	if c.maxAttempts == 0 {
		c.maxAttempts = 20
	}
	if c.lossRate == 0 {
		c.lossRate = 0.05
	}
	if c.failoverRate == 0 {
		c.failoverRate = 0.5
	}
	return c
}

// result is one design's run.
type result struct {
	ops        int
	executions int // runs that committed their effect (and their record)
	doubles    int // executions beyond the first of each key
	refusals   int // answers that told the client to wait or retry
	completed  int // operations the client saw finished within its budget
	p50, p99   time.Duration
}

// availability is the share of operations completed within the budget.
func (r result) availability() float64 { return float64(r.completed) / float64(r.ops) }

const regions = 3

// downRegion, c of a, b and c, goes down in a run with a region down.
const downRegion = 2

// op is one operation: its client and its key.
type op struct {
	key       int
	rng       *rand.Rand
	start     time.Duration
	near      int // the client's nearest region
	keyRegion int // pinned: the key's region; home: the home in the key
	region    int // where the next attempt goes
	attempts  int
	sentAt    time.Duration
	answered  int           // the attempt last answered
	first     int           // the region the key was first sent to, or -1
	firstSent time.Duration // when
	done      bool
	failed    bool
}

// event is a callback at a virtual time; seq orders events of one time.
type event struct {
	at  time.Duration
	seq int64
	fn  func()
}

type queue []event

func (q queue) Len() int { return len(q) }
func (q queue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q queue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *queue) Push(x any)   { *q = append(*q, x.(event)) }
func (q *queue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// sim is one run: a discrete-event simulation on virtual time, in one
// goroutine, so that a seed gives one result.
type sim struct {
	c      config
	d      design
	now    time.Duration
	seq    int64
	events queue
	tokens int64
	stores [regions]*regionStore
	global *regionStore // quorum's one store
	execs  []int        // committed runs by key
	res    result
	took   []time.Duration
}

// run simulates design d in world c.
func run(c config, d design) result {
	c = c.defaults()
	s := &sim{c: c, d: d, execs: make([]int, c.ops)}
	for r := range s.stores {
		s.stores[r] = newRegionStore(r, &s.tokens)
	}
	s.global = newRegionStore(0, &s.tokens)
	s.res.ops = c.ops
	for i := range c.ops {
		rng := rand.New(rand.NewPCG(c.seed, uint64(i)))
		o := &op{key: i, rng: rng, first: -1}
		o.start = time.Duration(rng.Int64N(int64(c.span)))
		o.near = rng.IntN(regions)
		o.keyRegion = o.near
		if d.kind == pinned {
			o.keyRegion = rng.IntN(regions) // by tenant, say: not where the client is
		}
		o.region = o.keyRegion
		s.at(o.start, func() { s.send(o) })
	}
	for s.events.Len() > 0 {
		e := heap.Pop(&s.events).(event)
		s.now = e.at
		e.fn()
	}
	for _, n := range s.execs {
		s.res.executions += n
		s.res.doubles += max(n-1, 0)
	}
	slices.Sort(s.took)
	if n := len(s.took); n > 0 {
		s.res.p50 = s.took[n/2]
		s.res.p99 = s.took[n*99/100]
	}
	return s.res
}

func (s *sim) at(t time.Duration, fn func()) {
	s.seq++
	heap.Push(&s.events, event{at: t, seq: s.seq, fn: fn})
}

// up reports whether region r is up at t.
func (s *sim) up(r int, t time.Duration) bool {
	return !s.c.down || r != downRegion || t < s.c.downAt || t >= s.c.downAt+s.c.downFor
}

// upThrough reports whether region r is up over all of [from, to].
func (s *sim) upThrough(r int, from, to time.Duration) bool {
	if !s.c.down || r != downRegion {
		return true
	}
	return to < s.c.downAt || from >= s.c.downAt+s.c.downFor
}

// latency is one way between o's client and region r.
func (s *sim) latency(o *op, r int) time.Duration {
	if r == o.near {
		return s.c.near
	}
	return s.c.far
}

// send sends o's next attempt, unless its budget is spent.
func (s *sim) send(o *op) {
	if o.attempts >= s.c.maxAttempts || s.now-o.start > s.c.budget {
		o.failed = true
		return
	}
	o.attempts++
	a, r := o.attempts, o.region
	o.sentAt = s.now
	lat := s.latency(o, r)
	if !s.up(r, s.now) {
		// Refused at once (the region's front door, or a refused
		// connection): the request was not sent, so it is not the key's
		// first sending.
		s.at(s.now+2*lat, func() { s.answer(o, a, false, 0, true) })
		return
	}
	if o.first < 0 {
		o.first, o.firstSent = r, s.now
	}
	s.at(s.now+lat, func() { s.arrive(o, a, r) })
	s.at(s.now+s.c.deadline, func() {
		if o.attempts == a && o.answered != a && !o.done && !o.failed {
			s.retry(o, 0, false)
		}
	})
}

// answer is what reaches o's client for attempt a: done (a result or a
// replay) or a refusal that asks to wait retryAfter.
func (s *sim) answer(o *op, a int, done bool, retryAfter time.Duration, regionDown bool) {
	if o.attempts != a || o.done || o.failed || s.now > o.sentAt+s.c.deadline {
		return // the client has moved on
	}
	o.answered = a
	if !done {
		s.res.refusals++
		s.retry(o, retryAfter, regionDown)
		return
	}
	if o.rng.Float64() < s.c.lossRate { // the reply is lost: a reset connection
		s.retry(o, 0, false)
		return
	}
	if s.execs[o.key] == 0 {
		panic("regions: an operation completed that no run committed")
	}
	o.done = true
	s.res.completed++
	s.took = append(s.took, s.now-o.start)
}

// retry schedules o's next attempt after gRPC's exponential backoff (0.1 s,
// times 1.6 an attempt, at most 5 s, a random share of it) or retryAfter if
// longer, and fails o over to another region at random (always, from a
// region that is down) unless its design pins it.
func (s *sim) retry(o *op, retryAfter time.Duration, regionDown bool) {
	b := 100 * time.Millisecond
	for range o.attempts - 1 {
		b = min(b*16/10, 5*time.Second)
	}
	wait := max(time.Duration(o.rng.Int64N(int64(b))), retryAfter)
	if s.d.kind != pinned && (regionDown || o.rng.Float64() < s.c.failoverRate) {
		o.region = (o.region + 1 + o.rng.IntN(regions-1)) % regions
	}
	s.at(s.now+wait, func() { s.send(o) })
}

// reply sends an answer from region r back to o's client.
func (s *sim) reply(o *op, a, r int, done bool, retryAfter time.Duration) {
	if !s.up(r, s.now) {
		return
	}
	s.at(s.now+s.latency(o, r), func() { s.answer(o, a, done, retryAfter, false) })
}

// arrive serves attempt a of o at region r, as the design does.
func (s *sim) arrive(o *op, a, r int) {
	if !s.up(r, s.now) {
		return
	}
	back := func(done bool, retryAfter time.Duration) { s.reply(o, a, r, done, retryAfter) }
	switch s.d.kind {
	case pinned, lww:
		s.serve(o, r, s.stores[r], 0, back)
	case quorum:
		s.serve(o, r, s.global, 2*s.c.inter, back) // a majority's round trip: the nearest other region
	case home:
		if r == o.keyRegion {
			s.serve(o, r, s.stores[r], 0, back)
			return
		}
		h := o.keyRegion
		// Forwarded: a region that is down refuses the connection.
		s.at(s.now+s.c.inter, func() {
			if !s.up(h, s.now) {
				s.at(s.now+s.c.inter, func() { back(false, s.c.maxRetryAfter) })
				return
			}
			s.serve(o, h, s.stores[h], 0, func(done bool, retryAfter time.Duration) {
				s.at(s.now+s.c.inter, func() { back(done, retryAfter) })
			})
		})
	case fence:
		if s.fenced(o, r) {
			back(false, s.c.maxRetryAfter)
			return
		}
		s.serve(o, r, s.stores[r], 0, back)
	}
}

// fenced reports whether region r refuses o's key: first sent elsewhere,
// and r has no record of it yet (or only another region's whose lease has
// ended, whose completion may still be on its way), within the bound.
func (s *sim) fenced(o *op, r int) bool {
	if o.first == r || (s.d.bound > 0 && s.now >= o.firstSent+s.d.bound) {
		return false
	}
	rec := s.stores[r].find(o.key, s.now)
	switch {
	case rec == nil:
		return true
	case rec.completed:
		return false
	}
	return rec.ver.region != r && s.now >= rec.leaseEnd
}

// serve is the engine's request path at region r on store st, each store
// write taking rtt (a quorum's round trip; 0 for the region's own): reserve;
// a completed record is replayed, a held one refused with its lease's time
// left (at most maxRetryAfter); an acquired key runs the handler, whose
// effect commits with the record (atomic mode) if r is up throughout and the
// token still holds the key. The engine's 2 s hold of a duplicate is not
// modelled: it is refused at once.
func (s *sim) serve(o *op, r int, st *regionStore, rtt time.Duration, back func(bool, time.Duration)) {
	start := s.now
	s.at(start+rtt/2, func() {
		if !s.upThrough(r, start, s.now) {
			return
		}
		e := st.reserve(o.key, 1, s.c.lease, s.c.retention, s.now)
		s.replicate(r, o.key, st)
		after := func(fn func()) { s.at(s.now+rtt/2, fn) }
		switch e.state {
		case completed:
			after(func() { back(true, 0) })
		case held:
			after(func() { back(false, min(e.retryAfter, s.c.maxRetryAfter)) })
		case acquired:
			began := s.now + rtt/2
			s.at(began+s.handler(o)+rtt/2, func() {
				if !s.upThrough(r, began, s.now) {
					return // the region went down mid-run: nothing committed
				}
				if !st.complete(o.key, e.token, s.now) {
					// Another region's record replaced this one (last
					// writer wins): the transaction does not commit, and
					// the call answers from the record it finds.
					rec := st.find(o.key, s.now)
					after(func() { back(rec != nil && rec.completed, s.c.maxRetryAfter) })
					return
				}
				s.execs[o.key]++
				s.replicate(r, o.key, st)
				after(func() { back(true, 0) })
			})
		}
	})
}

// handler is one run's time: 20 ms plus an exponential 60 ms on average,
// and one run in 50 slow, 1 to 3 s (past the client's deadline).
func (s *sim) handler(o *op) time.Duration {
	if o.rng.Float64() < 0.02 {
		return time.Second + time.Duration(o.rng.Int64N(int64(2*time.Second)))
	}
	return 20*time.Millisecond + time.Duration(o.rng.ExpFloat64()*float64(60*time.Millisecond))
}

// replicate copies region r's record of key to the other regions after the
// lag, in designs that replicate asynchronously. A region that is down
// sends what it had not sent once it is back.
func (s *sim) replicate(r, key int, st *regionStore) {
	if !s.d.replicates() {
		return
	}
	copied := *st.recs[key]
	when := s.now + s.c.lag
	if !s.upThrough(r, s.now, when) {
		when = s.c.downAt + s.c.downFor + s.c.lag
	}
	for to := range regions {
		if to == r {
			continue
		}
		if s.c.lag == 0 && when == s.now {
			s.stores[to].apply(key, copied)
			continue
		}
		s.at(when, func() { s.stores[to].apply(key, copied) })
	}
}
