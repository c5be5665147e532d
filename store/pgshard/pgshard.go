package pgshard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemkey/idemkey/internal/waitset"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// ErrMoving refuses a call of a tenant being moved between shards
// (WithMoving): it wraps store.ErrUnavailable, so the engine answers it as
// a store that is down, and nothing was written.
var ErrMoving = fmt.Errorf("idemkey pgshard: the tenant is being moved to another shard: %w", store.ErrUnavailable)

// errNoPartition is a programming error: a store call made outside the
// engine without the partition the engine gives every one.
var errNoPartition = errors.New("idemkey pgshard: the call's context carries no partition, so its shard is unknown: " +
	"the engine gives every store call its tenant's (store.ContextWithPartition); a call made outside the engine must too")

// Option configures a Store.
type Option func(*options)

type options struct {
	tenants map[string]int
	moving  []string
	meters  metric.MeterProvider
}

// WithTenants routes each tenant of the map to the shard at its index in
// New's shards, rather than by the hash. The tenants are hashed at New
// (store.TenantPartition) and their names not kept. Repeated, the maps are
// merged.
func WithTenants(shards map[string]int) Option {
	return func(o *options) {
		for tenant, i := range shards {
			o.tenants[tenant] = i
		}
	}
}

// WithMoving refuses the calls of tenants, with ErrMoving, while their
// records are moved to another shard (docs/stores.md, "Moving a tenant"):
// a call is refused, rather than split across two shards. What starts or
// reads a key is refused (Reserve, Begin, Find, Lookup, and a batch's calls
// of these tenants alone, its others decided); the rest acts for a run that
// holds its key, which this Store gives none of these tenants. Under
// engine.WithFailOpen a refused two-phase call runs unprotected, as on any
// store failure.
func WithMoving(tenants ...string) Option {
	return func(o *options) { o.moving = append(o.moving, tenants...) }
}

// WithMeterProvider is where the Store records idemkey.shard.duration: each
// call's time on its shard, by the shard's index (idemkey.shard) and the
// operation (idemkey.store.operation), with error.type on a failure. The
// engine's idemkey.store.duration counts the Store as one; this tells the
// shards apart. Nil, the default, is the global MeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) { o.meters = mp }
}

// Store is a store.Store over several PostgreSQL stores, the shards, that
// routes each call to its tenant's shard. It is safe for concurrent use.
type Store struct {
	shards []*postgres.Store
	routes map[store.Partition]int // WithTenants
	moving map[store.Partition]bool
	took   metric.Float64Histogram // idemkey.shard.duration
	// recordOpts are took's attribute sets (recordOptions).
	recordOpts [][numOps][2]metric.RecordOption
}

var (
	_ store.Store         = (*Store)(nil)
	_ store.Sweeper       = (*Store)(nil)
	_ store.Finder        = (*Store)(nil)
	_ store.Looker        = (*Store)(nil)
	_ store.Watcher       = (*Store)(nil)
	_ store.Renewer       = (*Store)(nil)
	_ store.Stepper       = (*Store)(nil)
	_ store.BatchAtomic   = (*Store)(nil)
	_ store.BatchReserver = (*Store)(nil)
)

// New returns a Store over shards, each a store on its own database (its
// table migrated, as postgres.New requires). Their order is the routing:
// add a shard at the end, never in the middle (see the package doc).
func New(shards []*postgres.Store, opts ...Option) (*Store, error) {
	if len(shards) == 0 {
		return nil, errors.New("idemkey pgshard: New needs at least one shard")
	}
	for i, sh := range shards {
		if sh == nil {
			return nil, fmt.Errorf("idemkey pgshard: shard %d is nil", i)
		}
	}
	o := options{tenants: map[string]int{}}
	for _, opt := range opts {
		opt(&o)
	}
	s := &Store{shards: shards, routes: make(map[store.Partition]int, len(o.tenants)), moving: make(map[store.Partition]bool, len(o.moving))}
	if o.meters == nil {
		o.meters = otel.GetMeterProvider()
	}
	// The API's instruments work even when their creation reports an error.
	s.took, _ = o.meters.Meter("github.com/idemkey/idemkey/store/pgshard").Float64Histogram("idemkey.shard.duration",
		metric.WithUnit("s"), metric.WithDescription("Duration of the idempotency store's operations on each shard."),
		metric.WithExplicitBucketBoundaries(store.DurationBuckets...))
	s.recordOpts = recordOptions(len(shards))
	for tenant, i := range o.tenants {
		if i < 0 || i >= len(shards) {
			return nil, fmt.Errorf("idemkey pgshard: WithTenants routes a tenant to shard %d, but there are %d shards (0 to %d)", i, len(shards), len(shards)-1)
		}
		s.routes[store.TenantPartition(tenant)] = i
	}
	for _, tenant := range o.moving {
		s.moving[store.TenantPartition(tenant)] = true
	}
	return s, nil
}

// Shards are the shards, in New's order: each has its own Stats, Records,
// outbox relay and migrations.
func (s *Store) Shards() []*postgres.Store { return slices.Clone(s.shards) }

// ShardOf is the index of tenant's shard, where its atomic calls commit:
// the shard whose database holds its business data.
func (s *Store) ShardOf(tenant string) int { return s.index(store.TenantPartition(tenant)) }

func (s *Store) index(p store.Partition) int {
	if i, ok := s.routes[p]; ok {
		return i
	}
	return jump(binary.BigEndian.Uint64(p[:]), len(s.shards))
}

// jump is Lamping and Veach's jump consistent hash of key over n buckets:
// a bucket added at the end takes about 1/n of the keys, from every other
// bucket, and no other key moves. Where each tenant's records and data
// live depends on it: it never changes.
func jump(key uint64, n int) int {
	b, j := int64(-1), int64(0)
	for j < int64(n) {
		b = j
		key = key*2862933555777941757 + 1
		j = int64(float64(b+1) * (float64(int64(1)<<31) / float64((key>>33)+1)))
	}
	return int(b)
}

// route is p's shard and its index; a partition being moved is ErrMoving
// when refuse.
func (s *Store) route(p store.Partition, refuse bool) (*postgres.Store, int, error) {
	if refuse && s.moving[p] {
		return nil, 0, ErrMoving
	}
	i := s.index(p)
	return s.shards[i], i, nil
}

// shard is the shard of the partition ctx carries (store.PartitionFromContext).
func (s *Store) shard(ctx context.Context, refuse bool) (*postgres.Store, int, error) {
	p, ok := store.PartitionFromContext(ctx)
	if !ok {
		return nil, 0, errNoPartition
	}
	return s.route(p, refuse)
}

// shardOp is an operation on a shard, as idemkey.shard.duration names it.
type shardOp int

const (
	opReserve shardOp = iota
	opComplete
	opRelease
	opFind
	opLookup
	opRenew
	opStartStep
	opFinishStep
	opForgetSteps
	opBegin
	opSweep
	opReserveBatch
	opBeginBatch
	numOps
)

var opNames = [numOps]string{"reserve", "complete", "release", "find", "lookup", "renew",
	"start_step", "finish_step", "forget_steps", "begin", "sweep", "reserve_batch", "begin_batch"}

// recordOptions are idemkey.shard.duration's attribute sets, by shard,
// operation and whether it failed, made once at New as the engine makes its
// own (engine/observe.go), so that a call builds none.
func recordOptions(shards int) [][numOps][2]metric.RecordOption {
	opts := make([][numOps][2]metric.RecordOption, shards)
	for i := range opts {
		for op := range numOps {
			for failed := range 2 {
				attrs := []attribute.KeyValue{attribute.Int("idemkey.shard", i), attribute.String("idemkey.store.operation", opNames[op])}
				if failed == 1 {
					attrs = append(attrs, attribute.String("error.type", "store_failed"))
				}
				opts[i][op][failed] = metric.WithAttributeSet(attribute.NewSet(attrs...))
			}
		}
	}
	return opts
}

// shardTimer times a call of op on shard i as idemkey.shard.duration; start
// is zero when the instrument is disabled, so that a call without metrics
// reads no clock (as the engine's store timer does).
type shardTimer struct {
	s     *Store
	i     int
	op    shardOp
	start time.Time
}

// timer starts timing op on shard i.
func (s *Store) timer(ctx context.Context, i int, op shardOp) shardTimer {
	t := shardTimer{s: s, i: i, op: op}
	if s.took.Enabled(ctx) {
		t.start = time.Now()
	}
	return t
}

// end records the call's time, which ended with err.
func (t shardTimer) end(ctx context.Context, err error) {
	if t.start.IsZero() {
		return
	}
	failed := 0
	if err != nil {
		failed = 1
	}
	t.s.took.Record(context.WithoutCancel(ctx), time.Since(t.start).Seconds(), t.s.recordOpts[t.i][t.op][failed])
}

// Reserve implements store.Store on r.Partition's shard.
func (s *Store) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	sh, i, err := s.route(r.Partition, true)
	if err != nil {
		return store.Entry{}, err
	}
	t := s.timer(ctx, i, opReserve)
	res, err := sh.Reserve(ctx, r)
	t.end(ctx, err)
	return res, err
}

// Complete implements store.Store on the shard of ctx's partition.
func (s *Store) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return err
	}
	t := s.timer(ctx, i, opComplete)
	err = sh.Complete(ctx, key, token, outcome)
	t.end(ctx, err)
	return err
}

// Release implements store.Store on the shard of ctx's partition.
func (s *Store) Release(ctx context.Context, key store.Key, token store.Token) error {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return err
	}
	t := s.timer(ctx, i, opRelease)
	err = sh.Release(ctx, key, token)
	t.end(ctx, err)
	return err
}

// Find implements store.Finder on the shard of ctx's partition.
func (s *Store) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	sh, i, err := s.shard(ctx, true)
	if err != nil {
		return store.Entry{}, false, err
	}
	t := s.timer(ctx, i, opFind)
	res, ok, err := sh.Find(ctx, key)
	t.end(ctx, err)
	return res, ok, err
}

// Lookup implements store.Looker on the shard of ctx's partition.
func (s *Store) Lookup(ctx context.Context, key store.Key) (store.Entry, []string, bool, error) {
	sh, i, err := s.shard(ctx, true)
	if err != nil {
		return store.Entry{}, nil, false, err
	}
	t := s.timer(ctx, i, opLookup)
	res, steps, ok, err := sh.Lookup(ctx, key)
	t.end(ctx, err)
	return res, steps, ok, err
}

// Renew implements store.Renewer on the shard of ctx's partition.
func (s *Store) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return err
	}
	t := s.timer(ctx, i, opRenew)
	err = sh.Renew(ctx, key, token, lease)
	t.end(ctx, err)
	return err
}

// StartStep implements store.Stepper on the shard of ctx's partition.
func (s *Store) StartStep(ctx context.Context, st store.StepStart) (store.StepEntry, error) {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return store.StepEntry{}, err
	}
	t := s.timer(ctx, i, opStartStep)
	res, err := sh.StartStep(ctx, st)
	t.end(ctx, err)
	return res, err
}

// FinishStep implements store.Stepper on the shard of ctx's partition.
func (s *Store) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return err
	}
	t := s.timer(ctx, i, opFinishStep)
	err = sh.FinishStep(ctx, key, token, name, result)
	t.end(ctx, err)
	return err
}

// ForgetSteps implements store.Stepper on the shard of ctx's partition.
func (s *Store) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	sh, i, err := s.shard(ctx, false)
	if err != nil {
		return err
	}
	t := s.timer(ctx, i, opForgetSteps)
	err = sh.ForgetSteps(ctx, key, token, names...)
	t.end(ctx, err)
	return err
}

// Begin implements store.Atomic in a transaction on r.Partition's shard:
// the handler's postgres.TxFromContext is that shard's.
func (s *Store) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	sh, i, err := s.route(r.Partition, true)
	if err != nil {
		return store.Entry{}, nil, err
	}
	t := s.timer(ctx, i, opBegin)
	res, tx, err := sh.Begin(ctx, r)
	t.end(ctx, err)
	return res, tx, err
}

// Sweep implements store.Sweeper on every shard in turn; a shard that
// fails does not keep the others from being swept.
func (s *Store) Sweep(ctx context.Context, batchSize int) (int, error) {
	total := 0
	var errs []error
	for i, sh := range s.shards {
		t := s.timer(ctx, i, opSweep)
		n, err := sh.Sweep(ctx, batchSize)
		t.end(ctx, err)
		total += n
		if err != nil {
			errs = append(errs, fmt.Errorf("shard %d: %w", i, err))
		}
	}
	return total, errors.Join(errs...)
}

// Watch implements store.Watcher, which names no tenant: it asks every
// shard, and only the key's shard can hold the key (the others answer at
// once that they do not). Its channel is that shard's; closed at once if
// none holds it; nil (never told: the engine polls) if none holds it and a
// shard does not listen.
func (s *Store) Watch(key store.Key) (<-chan struct{}, func()) {
	var (
		held     <-chan struct{}
		stops    []func()
		deaf     bool
		stopHeld func()
	)
	for _, sh := range s.shards {
		ch, stop := sh.Watch(key)
		switch {
		case ch == nil:
			deaf = true
			stop()
		case closed(ch):
			stop()
		case held == nil:
			held, stopHeld = ch, stop
		default: // held on two shards: only during a move, which refuses new calls
			stops = append(stops, stop)
		}
	}
	for _, stop := range stops {
		stop()
	}
	switch {
	case held != nil:
		return held, stopHeld
	case deaf:
		return nil, func() {}
	}
	return waitset.Closed, func() {}
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Listen runs each shard's Listen (postgres.Store.Listen) until ctx ends,
// then returns ctx's error, joined with any other a shard's Listen
// returned: go st.Listen(ctx).
func (s *Store) Listen(ctx context.Context) error {
	errs := make([]error, len(s.shards))
	var wg sync.WaitGroup
	for i, sh := range s.shards {
		wg.Go(func() {
			if err := sh.Listen(ctx); err != nil && !errors.Is(err, ctx.Err()) {
				errs[i] = fmt.Errorf("shard %d: %w", i, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return errors.Join(err, ctx.Err())
	}
	return ctx.Err()
}
