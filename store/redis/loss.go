package redis

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/store"
)

// How the store notices that its data was lost (docs/redis.md, "Data loss",
// has it in full): a marker key per slot holds the epoch New read, and a
// write counter per slot must not fall below the highest this store saw;
// both never expire, and a script that finds either gone, changed, behind or
// expiring refuses. Markers come back only through New: a store never writes
// one again by itself. The servers' maxmemory_policy and evicted_keys are
// read again after each check interval (admit).

// slots is the number of hash slots of a Redis Cluster.
const slots = 16384

// crcTable is CRC-16/XMODEM's, with which Redis Cluster hashes key names.
var crcTable = func() (t [256]uint16) {
	for i := range t {
		crc := uint16(i) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
		t[i] = crc
	}
	return t
}()

// slotOf returns the hash slot of a hash tag.
func slotOf(tag string) int {
	var crc uint16
	for i := 0; i < len(tag); i++ {
		crc = crc<<8 ^ crcTable[byte(crc>>8)^tag[i]]
	}
	return int(crc % slots)
}

// slotTags holds, for each hash slot, the smallest decimal number that
// hashes to it, the tag of the slot's marker: about 110,000 hashes, once.
var slotTags = sync.OnceValue(func() *[slots]string {
	var tags [slots]string
	for n, left := 0, slots; left > 0; n++ {
		tag := strconv.Itoa(n)
		if slot := slotOf(tag); tags[slot] == "" {
			tags[slot] = tag
			left--
		}
	}
	return &tags
})

func (s *Store) markerName(slot int) string {
	if s.cluster == nil {
		return s.marker
	}
	return s.opts.prefix + ":epoch:{" + slotTags()[slot] + "}"
}

func (s *Store) counterName(slot int) string {
	if s.cluster == nil {
		return s.counter
	}
	return s.opts.prefix + ":writes:{" + slotTags()[slot] + "}"
}

// keys returns the KEYS of a script on key's record (the record, its slot's
// marker and counter), and the slot's index in s.epochs and s.seen.
func (s *Store) keys(key store.Key) ([]string, int) {
	p := s.opts.prefix
	b := make([]byte, 0, len(p)+3+2*len(key))
	name := string(append(hex.AppendEncode(append(b, p+":{"...), key[:]), '}'))
	if s.cluster == nil {
		return []string{name, s.marker, s.counter}, 0
	}
	slot := slotOf(name[len(p)+2 : len(name)-1]) // the hash tag
	return []string{name, s.markerName(slot), s.counterName(slot)}, slot
}

// argv returns a script's ARGV on slot: the clock's offset, the epoch and
// the highest write count seen there, then args.
func (s *Store) argv(slot int, args ...any) []any {
	return append(append(make([]any, 0, 3+len(args)), s.offset(), s.epochs[slot], s.seen[slot].Load()), args...)
}

func (s *Store) saw(slot int, n int64) {
	seen := &s.seen[slot]
	for {
		old := seen.Load()
		if n <= old || seen.CompareAndSwap(old, n) {
			return
		}
	}
}

// markTimeout bounds mark, unless WithTimeout is longer: a marker per hash
// slot takes a busy machine more than one operation's time.
const markTimeout = 30 * time.Second

// mark reads every marker and write counter, writes the missing markers with
// a new epoch (SET NX, then GET), and keeps what each holds. A full server
// refuses the writes, not the reads: a store starts there if its markers
// exist.
func (s *Store) mark(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, max(s.opts.timeout, markTimeout))
	defer cancel()
	n := 1
	if s.cluster != nil {
		n = slots
	}
	got, counts := make([]*goredis.StringCmd, n), make([]*goredis.StringCmd, n)
	read := func(which []int, epoch string) error {
		_, err := s.client.Pipelined(ctx, func(p goredis.Pipeliner) error {
			for _, i := range which {
				if epoch != "" {
					p.SetNX(ctx, s.markerName(i), epoch, 0)
				} else {
					counts[i] = p.Get(ctx, s.counterName(i))
				}
				got[i] = p.Get(ctx, s.markerName(i))
			}
			return nil
		})
		if err == nil {
			return nil
		}
		for _, i := range which { // a missing marker or counter is no error
			for _, c := range []*goredis.StringCmd{got[i], counts[i]} {
				if err := c.Err(); err != nil && !errors.Is(err, goredis.Nil) {
					return s.translate(ctx, "markers", err)
				}
			}
		}
		return nil
	}
	all := make([]int, n)
	for i := range all {
		all[i] = i
	}
	if err := read(all, ""); err != nil {
		return err
	}
	var missing []int
	for i, c := range got {
		if c.Err() != nil {
			missing = append(missing, i)
		}
	}
	epoch := ""
	if len(missing) > 0 {
		var b [8]byte
		rand.Read(b[:])
		epoch = time.Now().UTC().Format("20060102T150405Z-") + hex.EncodeToString(b[:])
		if err := read(missing, epoch); err != nil {
			return err
		}
	}
	s.seen = make([]atomic.Int64, n)
	for i, c := range counts {
		seen, _ := strconv.ParseInt(c.Val(), 10, 64) // none yet: 0
		s.seen[i].Store(seen)
	}
	s.epochs = make([]any, n)
	for i, c := range got {
		epoch := c.Val() // "" if flushed meanwhile: then the first call fails
		if i > 0 && epoch == got[i-1].Val() {
			s.epochs[i] = s.epochs[i-1] // one boxed string for the usual one epoch
		} else {
			s.epochs[i] = epoch
		}
	}
	switch {
	case len(missing) == n:
		s.opts.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey redis: a new data set: the store wrote its markers",
			slog.String("prefix", s.opts.prefix), slog.String("epoch", epoch))
	case len(missing) > 0:
		s.opts.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey redis: markers were missing and are written again: "+
			"their hash slots lost their records before this store started (a node flushed, or failed over to an empty replica), "+
			"unless another store wrote them at the same moment; stores started before fail closed until restarted",
			slog.String("prefix", s.opts.prefix), slog.Int("slots", len(missing)), slog.String("epoch", epoch))
	}
	return nil
}

// dataLost is the cause of a script's IDEMKEY_DATALOST reply: "<marker>
// missing", "<marker> changed", "<counter> behind <value> <seen>",
// "<counter> gone <seen>", or "<marker or counter> expiring". All but the
// last are a loss (lost is true): the store fails for good. An expiry
// loses nothing yet, and refuses only until it is removed.
func (s *Store) dataLost(reply string) (lost bool, err error) {
	const after = "; every operation fails until this process restarts, which accepts that keys recorded before the loss may run again"
	f := strings.Fields(reply)
	switch {
	case len(f) == 4 && f[1] == "behind":
		return true, fmt.Errorf("%w: the Redis store's data was lost: its write counter %s holds %s, below the %s this process saw, "+
			"so the server went back to an older state (a restart from an older snapshot, RDB or AOF, or a failover to a replica that lagged) "+
			"and records written since may be gone, so a missing record no longer means a new key"+after,
			store.ErrDataLost, f[0], f[2], f[3])
	case len(f) == 3 && f[1] == "gone":
		return true, fmt.Errorf("%w: the Redis store's data was lost: its write counter %s is gone, though this process saw it at %s: "+
			"it expired (an expiry set on it: EXPIRE, or SET with EX), was deleted, or the server went back to a state from before it was written "+
			"(a restart from an older snapshot, a failover to a replica that lagged), and records written since may be gone, "+
			"so a missing record no longer means a new key"+after, store.ErrDataLost, f[0], f[2])
	case len(f) == 2 && f[1] == "expiring":
		what, then := "marker key", "a missing record would no longer tell a new key from one flushed"
		if strings.HasPrefix(f[0], s.opts.prefix+":writes") {
			what, then = "write counter", "the stores could no longer tell that the server went back to an older state"
		}
		return false, fmt.Errorf("%w: the Redis store's %s %s has an expiry (EXPIRE, or SET with EX, on it), which the store never gives it: "+
			"once it expires, %s; new keys are refused, and recorded keys replay, until the expiry is removed (PERSIST %s)",
			store.ErrDataLost, what, f[0], then, f[0])
	}
	marker, what := reply, "is gone"
	if len(f) == 2 {
		marker = f[0]
		if f[1] == "changed" {
			what = "holds the epoch of a store started after the loss"
		}
	}
	return true, fmt.Errorf("%w: the Redis store's data was lost: its marker key %s %s "+
		"(FLUSHDB or FLUSHALL, a restart without the data, a failover to an empty replica, eviction, or an expiry set on it), "+
		"so a missing record no longer means a new key"+after, store.ErrDataLost, marker, what)
}

type health struct {
	next     atomic.Int64 // UnixNano after which the next operation checks the servers
	checking sync.Mutex   // held by the operation that checks
	evicted  map[string]int64

	lost     atomic.Pointer[failure] // the data was lost: set once, for good
	evicting atomic.Pointer[failure] // a server may evict: cleared once none may
	alarmed  atomic.Int64            // UnixNano of the last Error logged
}

type failure struct{ err error }

type server struct {
	addr, runID, policy string
	evicted             int64
}

// inspect reads INFO memory, stats and server, in one round trip, of the
// one server, or in a cluster of every node (all) or every primary.
func (s *Store) inspect(ctx context.Context, all bool) ([]server, error) {
	var (
		mu    sync.Mutex
		found []server
	)
	look := func(ctx context.Context, c *goredis.Client) error {
		var mem, stats, srv *goredis.StringCmd
		if _, err := c.Pipelined(ctx, func(p goredis.Pipeliner) error {
			mem, stats, srv = p.Info(ctx, "memory"), p.Info(ctx, "stats"), p.Info(ctx, "server")
			return nil
		}); err != nil {
			return err
		}
		evicted, _ := strconv.ParseInt(infoField(stats.Val(), "evicted_keys"), 10, 64)
		mu.Lock()
		defer mu.Unlock()
		found = append(found, server{addr: c.Options().Addr, runID: infoField(srv.Val(), "run_id"),
			policy: infoField(mem.Val(), "maxmemory_policy"), evicted: evicted})
		return nil
	}
	var err error
	switch {
	case s.cluster == nil:
		err = look(ctx, s.client.(*goredis.Client))
	case all:
		err = s.cluster.ForEachShard(ctx, look)
	default:
		err = s.cluster.ForEachMaster(ctx, look)
	}
	return found, err
}

// admit starts every operation, the first after each check interval
// checking the servers. It refuses (store.ErrDataLost) once the data was
// lost, or while a server may evict.
func (s *Store) admit(ctx context.Context, op string) error {
	h := &s.health
	if h.lost.Load() == nil && time.Now().UnixNano() >= h.next.Load() && h.checking.TryLock() {
		if time.Now().UnixNano() >= h.next.Load() {
			s.check(ctx)
			h.next.Store(time.Now().Add(s.opts.checkInterval).UnixNano())
		}
		h.checking.Unlock()
	}
	f := h.lost.Load()
	if f == nil {
		if f = h.evicting.Load(); f == nil {
			return nil
		}
	}
	s.alarm(ctx, false, "idemkey redis: the store refuses every operation", f.err)
	return fmt.Errorf("idemkey redis: %s: %w", op, f.err)
}

// check reads every primary's maxmemory-policy and evicted_keys again. A
// server that does not answer is left for the next check.
func (s *Store) check(ctx context.Context) {
	h := &s.health
	servers, err := s.inspect(ctx, false)
	if err != nil {
		s.opts.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey redis: the check of the servers failed; it is tried again after the interval", slog.Any("error", err))
	}
	var evicting *server
	for _, srv := range servers {
		if last, ok := h.evicted[srv.runID]; ok && srv.evicted > last {
			s.lose(ctx, fmt.Errorf("%w: the Redis store's data was lost: a server evicted %d keys (INFO stats evicted_keys), records among them perhaps: "+
				"set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf), then restart this process, "+
				"which accepts that keys recorded before may run again; every operation fails until then", store.ErrDataLost, srv.evicted-last),
				slog.String("server", srv.addr))
		}
		h.evicted[srv.runID] = srv.evicted // restarted or reset: a new count
		if srv.policy != "noeviction" && srv.policy != "" && evicting == nil {
			evicting = &srv
		}
	}
	switch {
	case evicting != nil:
		f := &failure{fmt.Errorf("%w: a Redis server's maxmemory-policy is now %s, which may evict idempotency records and run their calls again: "+
			"set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf); every operation fails until then",
			store.ErrDataLost, evicting.policy)}
		if old := h.evicting.Swap(f); old == nil || old.err.Error() != f.err.Error() {
			s.alarm(ctx, true, "idemkey redis: a server may evict records; the store fails every operation until its maxmemory-policy is noeviction again",
				f.err, slog.String("server", evicting.addr))
		}
	case err == nil && h.evicting.Swap(nil) != nil:
		s.opts.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey redis: every server's maxmemory-policy is noeviction again, and none evicted a key: the store serves again")
	}
}

// lose fails the store for good with err, which wraps store.ErrDataLost,
// unless it failed so already, and returns the first such error.
func (s *Store) lose(ctx context.Context, err error, attrs ...slog.Attr) error {
	if s.health.lost.CompareAndSwap(nil, &failure{err}) {
		s.alarm(ctx, true, "idemkey redis: the store's data was lost; every operation fails until the process restarts", err, attrs...)
	}
	return s.health.lost.Load().err
}

// alarm logs msg at Error: when forced, or if nothing was for a minute.
func (s *Store) alarm(ctx context.Context, force bool, msg string, err error, attrs ...slog.Attr) {
	h := &s.health
	now := time.Now().UnixNano()
	if last := h.alarmed.Load(); force {
		h.alarmed.Store(now)
	} else if now-last < int64(time.Minute) || !h.alarmed.CompareAndSwap(last, now) {
		return
	}
	s.opts.logger.LogAttrs(ctx, slog.LevelError, msg, append(attrs, slog.Any("error", err))...)
}
