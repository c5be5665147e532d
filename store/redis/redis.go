package redis

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/store"
)

// DefaultPrefix starts the name of every key the store writes.
const DefaultPrefix = "idemkey"

const defaultTimeout = 5 * time.Second

const defaultCheckInterval = time.Second

// maxDuration bounds leases and retentions, so that the scripts' sums of
// microseconds stay exact in Lua's doubles (see scripts.go): 100 years.
const maxDuration = 100 * 365 * 24 * time.Hour

// Option configures a Store.
type Option func(*options)

type options struct {
	prefix        string
	timeout       time.Duration
	replicas      int
	logger        *slog.Logger
	checkInterval time.Duration
	// offset is added to the server's clock, for this package's tests only
	// (export_test.go); nil is none.
	offset func() time.Duration
}

// WithPrefix sets the start of every key's name (DefaultPrefix if empty): 1
// to 64 visible ASCII characters without braces, which would change the
// key's hash slot.
func WithPrefix(p string) Option {
	return func(o *options) { o.prefix = p }
}

// WithTimeout bounds each operation, the wait for replicas included (five
// seconds if d <= 0); Complete and Release use only this bound. go-redis
// applies a deadline to its socket reads only with ContextTimeoutEnabled;
// otherwise its ReadTimeout bounds each read, and concurrent calls share
// writes through the client's AutoPipeline, which keeps a queued script
// until its reply whatever the context.
func WithTimeout(d time.Duration) Option {
	return func(o *options) { o.timeout = d }
}

// WithReplicas makes Reserve (when it acquires) and Complete wait until n
// replicas confirm the write (WAIT), so that a failover cannot lose an
// acknowledged write; fewer within the timeout fail with
// store.ErrUnavailable. 0, the default, waits for none.
//
// On Redis before 8, go-redis v9.23's "auto" maintenance notifications race
// on the wait's connection: set the client's MaintNotificationsConfig to
// &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}.
func WithReplicas(n int) Option {
	return func(o *options) { o.replicas = max(n, 0) }
}

// WithClockOffset adds offset() to the server's clock in the scripts'
// decisions, so that a test can move time forward without sleeping; native
// expiry follows the real clock, so a record never disappears early. Never
// set it in production.
func WithClockOffset(offset func() time.Duration) Option {
	return func(o *options) { o.offset = offset }
}

// WithCheckInterval sets how often the store reads every primary's
// maxmemory-policy and evicted_keys again (a second if d <= 0), in the first
// operation after each interval.
func WithCheckInterval(d time.Duration) Option {
	return func(o *options) { o.checkInterval = d }
}

// WithLogger sets where the store logs: at Error, lost data or a server that
// may evict (once a minute at most while it refuses); at Debug, the driver's
// error behind each it translates. Nil, the default, discards.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) { o.logger = l }
}

// Store is a store.Store, store.Finder, store.Watcher, store.Stepper and
// store.Renewer on Redis. It is safe for concurrent use.
type Store struct {
	client  goredis.UniversalClient
	cluster *goredis.ClusterClient // set for a cluster: WAIT goes to the key's primary
	opts    options
	// epochs holds what the markers held in New (see loss.go): one for each
	// hash slot of a cluster, or the one server's, whose name is marker.
	// Each is boxed once, for a script's ARGV.
	epochs []any
	marker string
	// seen holds the highest value of each slot's write counter (of the one
	// server's, named counter) that New read or a write returned.
	seen    []atomic.Int64
	counter string
	health  health
	watch   watch // what Watch decides from (watch.go)
	// inflight counts the scripts on their way; pipelines says whether
	// they may share writes, through pipe (pipe.go).
	inflight  atomic.Int64
	pipelines bool
	pipe      atomic.Pointer[goredis.AutoPipeliner]
}

var (
	_ store.Store   = (*Store)(nil)
	_ store.Finder  = (*Store)(nil)
	_ store.Watcher = (*Store)(nil)
	_ store.Stepper = (*Store)(nil)
	_ store.Renewer = (*Store)(nil)
)

// New returns a store on client: a *goredis.Client (one server, or a
// Sentinel-managed primary) or a *goredis.ClusterClient. It refuses a server
// whose maxmemory-policy is not noeviction, reads the store's markers and
// write counters and writes those missing (within ctx and at most 30 s or
// WithTimeout), and subscribes for Watch on a connection of its own until
// the client is closed or Close is called; a server that refuses the
// subscription is logged, and the store polls.
func New(ctx context.Context, client goredis.UniversalClient, opts ...Option) (*Store, error) {
	o := options{prefix: DefaultPrefix, timeout: defaultTimeout}
	for _, opt := range opts {
		opt(&o)
	}
	if o.logger == nil {
		o.logger = slog.New(slog.DiscardHandler)
	}
	if o.timeout <= 0 {
		o.timeout = defaultTimeout
	}
	if o.checkInterval <= 0 {
		o.checkInterval = defaultCheckInterval
	}
	if o.prefix == "" {
		o.prefix = DefaultPrefix
	}
	if len(o.prefix) > 64 || strings.ContainsAny(o.prefix, "{}") || strings.IndexFunc(o.prefix, func(r rune) bool { return r < 0x21 || r > 0x7e }) >= 0 {
		return nil, fmt.Errorf("idemkey redis: prefix %q: want 1 to 64 visible ASCII characters without braces", o.prefix)
	}
	s := &Store{client: client, opts: o, marker: o.prefix + ":epoch", counter: o.prefix + ":writes"}
	switch c := client.(type) {
	case nil:
		return nil, errors.New("idemkey redis: New needs a client, not nil")
	case *goredis.ClusterClient:
		s.cluster = c
	case *goredis.Client:
	default:
		// A Ring moves a shard's keys to the others while it is down, and
		// they would find none of its records there.
		return nil, fmt.Errorf("idemkey redis: %T is not supported: use a *redis.Client or a *redis.ClusterClient", client)
	}
	s.pipelines = !contextTimeouts(client)
	if err := s.checkPolicy(ctx); err != nil {
		return nil, err
	}
	if err := s.mark(ctx); err != nil {
		return nil, err
	}
	if err := s.subscribe(ctx); err != nil {
		return nil, err
	}
	s.health.next.Store(time.Now().Add(o.checkInterval).UnixNano())
	return s, nil
}

// checkPolicy reads maxmemory_policy from INFO memory, which managed services
// that disable CONFIG still answer, on every node (a replica becomes a
// primary in a failover), and keeps each one's evicted_keys.
func (s *Store) checkPolicy(ctx context.Context) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	servers, err := s.inspect(ctx, true)
	if err != nil {
		return s.translate(ctx, "check maxmemory-policy", err)
	}
	s.health.evicted = make(map[string]int64, len(servers))
	for _, srv := range servers {
		switch srv.policy {
		case "noeviction":
			s.health.evicted[srv.runID] = srv.evicted
		case "":
			return errors.New("idemkey redis: the server's INFO memory has no maxmemory_policy, so the store cannot check that Redis never evicts its records")
		default:
			return fmt.Errorf("idemkey redis: the server's maxmemory-policy is %s, which may evict idempotency records and run a call twice: set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, or in redis.conf)", srv.policy)
		}
	}
	return nil
}

func infoField(info, name string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// offset is the test clock's offset in microseconds, as a script's ARGV[1].
func (s *Store) offset() any {
	if s.opts.offset == nil {
		return noOffset
	}
	return strconv.FormatInt(s.opts.offset().Microseconds(), 10)
}

// noOffset is offset's "0", boxed once rather than per call.
var noOffset any = "0"

func micros(d time.Duration) int64 { return min(max(d, 0), maxDuration).Microseconds() }

// Reserve implements store.Store with one script; with WithReplicas, an
// acquired reservation then waits for the replicas (see WithReplicas).
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "reserve"); err != nil {
		return store.Entry{}, err
	}
	args := []any{r.Fingerprint[:], micros(r.Lease), micros(r.Retention)}
	since := s.watch.heard.Load()
	acquired := func(v any) bool { a, _ := v.([]any); return len(a) > 0 && a[0] == int64(1) }
	keys, slot := s.keys(r.Key)
	v, err := s.run(ctx, "reserve", reserveScript, keys, slot, reserveCount, args...)
	if err != nil {
		if errors.Is(err, errNotReplicated) && acquired(v) {
			// Free the key rather than leave it in progress for a lease.
			a := v.([]any)
			_ = s.Release(ctx, r.Key, store.Token(a[1].(int64)))
		}
		return store.Entry{}, err
	}
	res, err := parseReservation(v)
	if now := s.now(); err == nil && res.State == store.Acquired {
		s.watch.holds(r.Key, now.Add(r.Lease), since, now)
	} else if err == nil && res.State == store.Held {
		s.watch.holds(r.Key, now.Add(res.RetryAfter), since, now)
	}
	return res, err
}

// parseReservation reads reserveScript's reply.
func parseReservation(v any) (store.Entry, error) {
	a, ok := v.([]any)
	if !ok || len(a) != 7 {
		return store.Entry{}, errors.New("idemkey redis: reserve: the script's reply has an unexpected shape")
	}
	kind, _ := a[0].(int64)
	token, _ := a[1].(int64)
	fp, _ := a[2].(string)
	outcome, _ := a[3].(string)
	left, _ := a[4].(int64)
	expires, _ := a[5].(int64)
	res := store.Entry{Expires: time.UnixMicro(expires)}
	switch kind {
	case 1:
		res.State, res.Token = store.Acquired, store.Token(token)
		return res, nil
	case 2:
		res.State, res.Outcome = store.Completed, []byte(outcome)
	case 3:
		res.State, res.RetryAfter = store.Held, time.Duration(left)*time.Microsecond // below maxDuration
	default:
		return store.Entry{}, errors.New("idemkey redis: reserve: the script's reply has an unexpected shape")
	}
	copy(res.Fingerprint[:], fp)
	return res, nil
}

// Find implements store.Finder with one read-only script.
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	if err := s.admit(ctx, "find"); err != nil {
		return store.Entry{}, false, err
	}
	keys, slot := s.keys(key)
	v, err := s.eval(ctx, findScript, keys, s.argv(slot))
	if errors.Is(err, goredis.Nil) {
		return store.Entry{}, false, nil
	}
	if err != nil {
		return store.Entry{}, false, s.translate(ctx, "find", err)
	}
	a, ok := v.([]any)
	if !ok || len(a) != 3 {
		return store.Entry{}, false, errors.New("idemkey redis: find: the script's reply has an unexpected shape")
	}
	fp, _ := a[0].(string)
	outcome, _ := a[1].(string)
	expires, _ := a[2].(int64)
	res := store.Entry{State: store.Completed, Outcome: []byte(outcome), Expires: time.UnixMicro(expires)}
	copy(res.Fingerprint[:], fp)
	return res, true, nil
}

// Complete implements store.Store, bounded by the store's timeout rather than
// ctx: a caller that hangs up must not leave its key in progress. A repeated
// Complete with the same token and outcome returns nil again.
func (s *Store) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if err := s.admit(ctx, "complete"); err != nil {
		return err
	}
	defer s.watch.forget(key)
	keys, slot := s.keys(key)
	return s.write(ctx, "complete", completeScript, keys, slot, writeCount, strconv.FormatInt(int64(token), 10), outcome)
}

// Release implements store.Store, detached from ctx's cancellation like
// Complete. It does not wait for replicas: a release lost in a failover
// leaves the key in progress until its lease ends, which delays a retry but
// never runs the handler twice.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	ctx, cancel := s.bound(context.WithoutCancel(ctx))
	defer cancel()
	if err := s.admit(ctx, "release"); err != nil {
		return err
	}
	defer s.watch.forget(key)
	keys, slot := s.keys(key)
	return s.write(ctx, "release", releaseScript, keys, slot, uncounted, strconv.FormatInt(int64(token), 10))
}

// write runs a fenced script on keys (Complete's, Release's, a step's or
// Renew's), whose reply is {1, count}, or {0, 0} if the lease was lost.
func (s *Store) write(ctx context.Context, op string, sc *goredis.Script, keys []string, slot int, count func(any) int64, args ...any) error {
	v, err := s.run(ctx, op, sc, keys, slot, count, args...)
	if err != nil {
		return err
	}
	if a, _ := v.([]any); len(a) != 2 || a[0] != int64(1) {
		return fmt.Errorf("idemkey redis: %s: %w", op, store.ErrLeaseLost)
	}
	return nil
}

// The write counter's value in the replies of reserveScript, and of
// completeScript and the step and renew scripts (made once, not per call);
// Release's and ForgetSteps' count nothing.
var (
	reserveCount = counted(6)
	writeCount   = counted(1)
	uncounted    = func(any) int64 { return 0 }
)

// counted returns a function that reads the write counter's value at index
// i of a script's reply: 0 if the script wrote nothing that counts.
func counted(i int) func(any) int64 {
	return func(v any) int64 {
		a, _ := v.([]any)
		if len(a) <= i {
			return 0
		}
		n, _ := a[i].(int64)
		return n
	}
}

// errNotReplicated marks a write that fewer replicas than WithReplicas asked
// for confirmed in time.
var errNotReplicated = errors.New("not confirmed by the replicas in time")

// run runs sc on keys, those of a record on slot (Store.keys). With WithReplicas, a write (count above 0) is followed
// by WAIT on the same connection, as WAIT requires. Only a confirmed write's
// counter raises what the store has seen of its slot, so that a failover
// that loses an unconfirmed one does not fail the store.
func (s *Store) run(ctx context.Context, op string, sc *goredis.Script, keys []string, slot int, count func(any) int64, args ...any) (any, error) {
	args = s.argv(slot, args...)
	if s.opts.replicas == 0 {
		v, err := s.eval(ctx, sc, keys, args)
		if err != nil {
			return nil, s.translate(ctx, op, err)
		}
		s.saw(slot, count(v))
		return v, nil
	}
	for attempt, wait := 1, 20*time.Millisecond; ; attempt, wait = attempt+1, min(2*wait, 250*time.Millisecond) {
		v, err := s.runWaiting(ctx, sc, keys, func(v any) bool { return count(v) > 0 }, args)
		if err == nil || errors.Is(err, errNotReplicated) {
			if err != nil {
				err = fmt.Errorf("idemkey redis: %s: %w: %w", op, store.ErrUnavailable, err)
			} else {
				s.saw(slot, count(v))
			}
			return v, err
		}
		// The primary moved (a failover, a resharding) or did not answer:
		// the script ran nowhere, or took effect unseen, which a retry finds
		// as a reservation in progress or an identical record.
		if s.cluster == nil || !redirected(err) || !store.Pause(ctx, wait) || attempt == 10 {
			return nil, s.translate(ctx, op, err)
		}
		s.cluster.ReloadState(ctx)
	}
}

func (s *Store) runWaiting(ctx context.Context, sc *goredis.Script, keys []string, wrote func(any) bool, args []any) (any, error) {
	var node *goredis.Client
	if s.cluster != nil {
		var err error
		if node, err = s.cluster.MasterForKey(ctx, keys[0]); err != nil {
			return nil, err
		}
	} else {
		node = s.client.(*goredis.Client)
	}
	conn := node.Conn()
	defer conn.Close()
	v, err := sc.Run(ctx, conn, keys, args...).Result()
	if err != nil || !wrote(v) {
		return v, err
	}
	timeout := 100 * time.Millisecond
	if deadline, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(deadline)*3/4, time.Millisecond) // WAIT 0 would wait forever
	}
	n, err := conn.Wait(ctx, s.opts.replicas, timeout).Result()
	switch {
	case err != nil:
		return v, err
	case n < int64(s.opts.replicas):
		return v, fmt.Errorf("%w: %d of %d replicas within %v", errNotReplicated, n, s.opts.replicas, timeout.Round(time.Millisecond))
	}
	return v, nil
}

// redirected reports whether err means the key's primary is elsewhere or
// not serving: worth asking the cluster again.
func redirected(err error) bool {
	if _, ok := goredis.IsMovedError(err); ok {
		return true
	}
	if _, ok := goredis.IsAskError(err); ok {
		return true
	}
	var netErr net.Error
	return goredis.IsClusterDownError(err) || goredis.IsTryAgainError(err) || goredis.IsReadOnlyError(err) ||
		goredis.IsLoadingError(err) || errors.As(err, &netErr) || errors.Is(err, goredis.ErrClosed) ||
		strings.Contains(err.Error(), "connection refused") || strings.Contains(err.Error(), "EOF")
}

// bound applies the store's timeout to ctx, unless ctx's own deadline comes
// sooner.
func (s *Store) bound(ctx context.Context) (context.Context, context.CancelFunc) {
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= s.opts.timeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, s.opts.timeout)
}

// translate turns a driver error into the store's own: a script's
// IDEMKEY_DATALOST is store.ErrDataLost for good, out of memory
// store.ErrFull, an unreachable, failing-over, loading or slow server or a
// cancelled call store.ErrUnavailable (the context's error kept); any other
// keeps only its first word, such as WRONGTYPE. The driver's error, which
// may name hosts, is logged at Debug.
func (s *Store) translate(ctx context.Context, op string, err error) error {
	s.opts.logger.LogAttrs(ctx, slog.LevelDebug, "idemkey redis: "+op+" failed", slog.Any("error", err))
	var redisErr goredis.Error
	isRedisErr := errors.As(err, &redisErr) && !errors.Is(err, goredis.ErrClosed)
	if isRedisErr {
		if reply, ok := strings.CutPrefix(redisErr.Error(), "IDEMKEY_DATALOST "); ok {
			lost, err := s.dataLost(reply)
			if !lost { // an expiry on a marker or counter: refused until it is removed
				s.alarm(ctx, false, "idemkey redis: a key of the store's that never expires has an expiry; new keys are refused until it is removed", err)
				return fmt.Errorf("idemkey redis: %s: %w", op, err)
			}
			return fmt.Errorf("idemkey redis: %s: %w", op, s.lose(ctx, err))
		}
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("idemkey redis: %s: %w: %w", op, store.ErrUnavailable, ctxErr)
	}
	if isRedisErr {
		msg := redisErr.Error()
		if strings.Contains(msg, "OOM ") {
			return fmt.Errorf("idemkey redis: %s: %w: the server is out of memory (maxmemory) and refuses writes", op, store.ErrFull)
		}
		word, _, _ := strings.Cut(strings.TrimPrefix(msg, "ERR "), " ")
		if redirected(err) || goredis.IsMasterDownError(err) || strings.HasPrefix(msg, "BUSY") || strings.HasPrefix(msg, "NOREPLICAS") {
			return fmt.Errorf("idemkey redis: %s: %w: server answered %s", op, store.ErrUnavailable, word)
		}
		return fmt.Errorf("idemkey redis: %s: server error %s", op, word)
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return fmt.Errorf("idemkey redis: %s: %w: timeout", op, store.ErrUnavailable)
	}
	return fmt.Errorf("idemkey redis: %s: %w: no connection to the server", op, store.ErrUnavailable)
}
