package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/idemkey/idemkey/store"
)

// Publisher sends messages to one broker: idemnats, idemamqp and idemkafka
// each build one. A new broker is a Publisher and a run of the publisher
// suite (tests/brokertest).
type Publisher interface {
	// Publish sends ms, each to its Destination with its ID as the broker's
	// duplicate id and, where the broker partitions or orders by a key,
	// its PartitionKey, and returns once the broker has confirmed or
	// refused each: nil if it confirmed all, else one error a message,
	// errs[i] for ms[i], nil for one confirmed. ms hold at most one message
	// of a PartitionKey. An error never quotes a message's payload.
	Publish(ctx context.Context, ms []Message) (errs []error)
}

// Relay sends an outbox's committed messages through a Publisher, and marks
// each sent once the broker has confirmed it: a message is sent at least
// once, never lost, and sent again (with the same id, which the broker's
// and the consumers' duplicate checks drop) only when a relay died or a
// confirmation was lost. Several relays may run on one outbox: each claims
// its messages for a lease.
type Relay struct {
	st     store.Outbox
	pub    Publisher
	sealer interface {
		Open(store.Key, []byte) ([]byte, error)
	}
	o    relayOptions
	wake chan struct{} // a transaction that wrote messages may have committed

	running         atomic.Bool  // Run is running
	pending, oldest atomic.Int64 // the last PendingMessages, oldest in nanoseconds
	sent, failed    metric.Int64Counter
	register        func() (metric.Registration, error) // the gauges' callback, registered while Run runs
	lastStats       time.Time                           // Run's goroutine's alone
	next            time.Time                           // the rate's: when the next claim may be sent
}

// RelayOption configures a Relay.
type RelayOption func(*relayOptions)

type relayOptions struct {
	batch         int
	lease         time.Duration
	rate          float64
	retention     time.Duration
	poll          time.Duration
	logger        *slog.Logger
	meterProvider metric.MeterProvider
}

// The RelayOptions' defaults.
const (
	defaultBatch     = 100
	defaultLease     = 30 * time.Second
	defaultRetention = 7 * 24 * time.Hour
	defaultPoll      = time.Second
	maxBackoff       = time.Minute // the longest wait before a failed message is tried again
)

// WithBatch is how many messages a relay claims and publishes at once: 100
// by default.
func WithBatch(n int) RelayOption { return func(o *relayOptions) { o.batch = n } }

// WithLease is how long a claim holds its messages from other relays (30 s
// by default, at least a second); a publish is given half of it.
func WithLease(d time.Duration) RelayOption { return func(o *relayOptions) { o.lease = d } }

// WithRate bounds how many messages a second the relay sends, to respect
// a broker's rate limit; 0, the default, sends as fast as it confirms.
func WithRate(perSecond float64) RelayOption { return func(o *relayOptions) { o.rate = perSecond } }

// WithRetention is how long a sent message is kept before the relay sweeps
// it: a week by default. While it is kept, a re-run's copy of it is dropped at the outbox:
// keep it at least as long as the operations' records.
func WithRetention(d time.Duration) RelayOption { return func(o *relayOptions) { o.retention = d } }

// WithPollInterval is how often a relay looks for messages without being
// woken by a commit (a lost notification, a failed send's backoff ending):
// a second by default.
func WithPollInterval(d time.Duration) RelayOption { return func(o *relayOptions) { o.poll = d } }

// WithLogger sets the logger (slog.Default() by default; nil discards). Its
// records name a message by its id, never its payload.
func WithLogger(l *slog.Logger) RelayOption {
	return func(o *relayOptions) {
		if l == nil {
			l = slog.New(slog.DiscardHandler)
		}
		o.logger = l
	}
}

// WithMeterProvider sets the meter of the relay's metrics (the global one
// by default): idemkey.outbox.pending, idemkey.outbox.oldest_age,
// idemkey.outbox.sent and idemkey.outbox.failed.
func WithMeterProvider(mp metric.MeterProvider) RelayOption {
	return func(o *relayOptions) {
		if mp != nil {
			o.meterProvider = mp
		}
	}
}

// Relay returns a relay of the outbox's messages to pub. It starts nothing:
// run it with go r.Run(ctx).
func (o *Outbox) Relay(pub Publisher, opts ...RelayOption) (*Relay, error) {
	ro := relayOptions{batch: defaultBatch, lease: defaultLease, retention: defaultRetention, poll: defaultPoll,
		logger: slog.Default(), meterProvider: otel.GetMeterProvider()}
	for _, opt := range opts {
		opt(&ro)
	}
	switch {
	case pub == nil:
		return nil, errors.New("idemkey outbox: Relay needs a Publisher, not nil")
	case ro.batch < 1:
		return nil, fmt.Errorf("idemkey outbox: WithBatch(%d): want at least 1", ro.batch)
	case ro.lease < time.Second:
		return nil, fmt.Errorf("idemkey outbox: WithLease(%v): want at least a second", ro.lease)
	case ro.rate != 0 && !(ro.rate >= 0.01) || math.IsInf(ro.rate, 0):
		return nil, fmt.Errorf("idemkey outbox: WithRate(%v): want 0.01 messages a second or more, or 0 for no bound", ro.rate)
	case ro.retention < 0:
		return nil, fmt.Errorf("idemkey outbox: WithRetention(%v): want 0 or more", ro.retention)
	case ro.poll < time.Millisecond:
		return nil, fmt.Errorf("idemkey outbox: WithPollInterval(%v): want at least a millisecond", ro.poll)
	}
	r := &Relay{st: o.st, pub: pub, o: ro, wake: make(chan struct{}, 1)}
	if o.sealer != nil {
		r.sealer = o.sealer
	}
	meter := ro.meterProvider.Meter("github.com/idemkey/idemkey/outbox")
	// The API's instruments work even when their creation reports an error.
	r.sent, _ = meter.Int64Counter("idemkey.outbox.sent", metric.WithUnit("{message}"),
		metric.WithDescription("Messages the relay sent and the broker confirmed."))
	r.failed, _ = meter.Int64Counter("idemkey.outbox.failed", metric.WithUnit("{message}"),
		metric.WithDescription("Sends of a message that failed; each is tried again after a backoff."))
	pending, _ := meter.Int64ObservableGauge("idemkey.outbox.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Messages committed and not yet sent, as the relay last counted them."))
	oldest, _ := meter.Float64ObservableGauge("idemkey.outbox.oldest_age", metric.WithUnit("s"),
		metric.WithDescription("How long ago the oldest unsent message was written, as the relay last looked."))
	r.register = func() (metric.Registration, error) {
		return meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
			obs.ObserveInt64(pending, r.pending.Load())
			obs.ObserveFloat64(oldest, time.Duration(r.oldest.Load()).Seconds())
			return nil
		}, pending, oldest)
	}
	return r, nil
}

// Run relays until ctx ends, then returns ctx's error. It listens for
// commits (store.Outbox's ListenMessages), and looks every poll interval
// besides. A failing store or broker is logged and tried again; nothing is
// dropped. It returns an error at once if the Relay is running already.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("idemkey outbox: Run: the relay is running already; make another Relay to run beside it")
	}
	defer r.running.Store(false)
	if reg, err := r.register(); err == nil {
		defer reg.Unregister()
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { r.listen(ctx) })
	wg.Go(func() { r.sweep(ctx) })
	for ctx.Err() == nil {
		more, err := r.round(ctx)
		if err != nil && ctx.Err() == nil {
			r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: the relay cannot claim messages; it tries again", slog.Any("error", err))
		}
		r.countPending(ctx)
		if more && err == nil {
			continue // more may be waiting
		}
		timer := time.NewTimer(r.o.poll)
		select {
		case <-r.wake:
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
	}
	return ctx.Err()
}

// listen wakes the relay on each commit of messages, listening again after
// a pause when its connection fails.
func (r *Relay) listen(ctx context.Context) {
	wake := func() {
		select {
		case r.wake <- struct{}{}:
		default:
		}
	}
	for wait := 100 * time.Millisecond; ctx.Err() == nil; wait = min(2*wait, 10*time.Second) {
		if err := r.st.ListenMessages(ctx, wake); err != nil {
			r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: the relay cannot listen for commits; it polls until it listens again", slog.Any("error", err))
		}
		if !sleep(ctx, wait) {
			return
		}
	}
}

// round claims a batch, sends it, and marks what the broker confirmed
// sent; more reports that the broker took some, so that more may be
// waiting: a claim takes only the oldest unsent message of each partition,
// so one short of a full batch does not mean that the outbox is drained
// (a partition's next message is claimable once this one is marked sent).
func (r *Relay) round(ctx context.Context) (more bool, err error) {
	limit := r.o.batch
	if r.o.rate > 0 {
		// A tenth of a second's messages at a time, so that the rate holds
		// over short windows too.
		limit = max(1, min(limit, int(r.o.rate/10)))
		if !sleep(ctx, time.Until(r.next)) {
			return false, nil
		}
	}
	rows, err := r.st.ClaimMessages(ctx, limit, r.o.lease)
	if err != nil || len(rows) == 0 {
		return false, err
	}
	if r.o.rate > 0 {
		r.next = time.Now().Add(time.Duration(float64(len(rows)) / r.o.rate * float64(time.Second)))
	}
	ms := make([]Message, 0, len(rows))
	opened := rows[:0:0] // ms[i]'s row
	var unopened []store.OutboxMessage
	for _, row := range rows {
		m, err := r.open(row)
		if err != nil {
			r.o.logger.LogAttrs(ctx, slog.LevelError, "idemkey outbox: a message does not open, and is not sent: restore the key that sealed it",
				slog.String("message_id", row.ID), slog.Any("error", err))
			unopened = append(unopened, row)
			continue
		}
		ms = append(ms, m)
		opened = append(opened, row)
	}
	var errs []error
	if len(ms) > 0 {
		pctx, cancel := context.WithTimeout(ctx, r.o.lease/2)
		errs = r.pub.Publish(pctx, ms)
		cancel()
	}
	if errs != nil && len(errs) != len(ms) {
		return false, fmt.Errorf("idemkey outbox: the publisher answered %d errors for %d messages", len(errs), len(ms))
	}
	var sent []string
	var failed []store.OutboxMessage
	first := -1 // the first failure, which the log tells of
	for i, m := range ms {
		if errs == nil || errs[i] == nil {
			sent = append(sent, m.ID)
			continue
		}
		failed = append(failed, opened[i])
		if first < 0 {
			first = i
		}
	}
	if first >= 0 {
		// One line a round, not a message: a broker that is down fails
		// every message of every batch.
		r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: messages were not sent; each is tried again after a backoff",
			slog.Int("messages", len(failed)), slog.String("message_id", ms[first].ID), slog.String("destination", ms[first].Destination),
			slog.Int("attempt", opened[first].Attempts), slog.Any("error", errs[first]))
	}
	// What the broker confirmed is marked even as the relay stops: else it
	// is sent again once its lease ends.
	wctx := context.WithoutCancel(ctx)
	if len(sent) > 0 {
		if err := r.st.MarkSent(wctx, sent); err != nil {
			r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: sent messages could not be marked sent; they are sent again when their lease ends",
				slog.Int("messages", len(sent)), slog.Any("error", err))
		}
		r.sent.Add(ctx, int64(len(sent)))
	}
	r.failed.Add(ctx, int64(len(failed)+len(unopened)))
	// One write for each backoff: a broker that is down fails a whole
	// batch, mostly of first attempts.
	retry := map[time.Duration][]store.OutboxMessage{}
	for _, m := range append(failed, unopened...) {
		d := r.backoff(m.Attempts)
		retry[d] = append(retry[d], m)
	}
	for d, ms := range retry {
		if err := r.st.RetryMessages(wctx, ms, d); err != nil {
			r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: failed messages' backoff could not be set; they are tried again when their lease ends",
				slog.Int("messages", len(ms)), slog.Any("error", err))
		}
	}
	// Again at once only if the broker took some: one that takes none
	// (down) is tried again at the next poll, not in a loop.
	return len(sent) > 0, nil
}

// sleep waits d, and reports false if ctx ended first.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// backoff is the wait after a message's attempt-th failed send: a quarter
// second, doubled each time, at most maxBackoff.
func (r *Relay) backoff(attempt int) time.Duration {
	d := 250 * time.Millisecond << min(max(attempt-1, 0), 20)
	return min(d, maxBackoff)
}

// open decodes row's body, opening it with the outbox's sealer.
func (r *Relay) open(row store.OutboxMessage) (Message, error) {
	m := Message{ID: row.ID, Destination: row.Destination, PartitionKey: row.PartitionKey}
	body := row.Body
	if r.sealer != nil {
		var err error
		if body, err = r.sealer.Open(messageKey(m), body); err != nil {
			return m, err
		}
	} else if len(body) > 0 && body[0] != bodyVersion {
		return m, errors.New("idemkey outbox: the message is sealed, and the outbox has no sealer (WithSealer)")
	}
	return m, decode(body, &m)
}

// countPending counts the pending messages for the metrics, at most once
// a second.
func (r *Relay) countPending(ctx context.Context) {
	if now := time.Now(); now.Sub(r.lastStats) >= time.Second {
		r.lastStats = now
		if n, oldest, err := r.st.PendingMessages(ctx); err == nil {
			r.pending.Store(n)
			r.oldest.Store(int64(oldest))
		}
	}
}

// sweep deletes the messages sent longer than the retention ago, at once
// and then every minute, in batches, until ctx ends: in a goroutine of its
// own, so that a week's first sweep holds no send up.
func (r *Relay) sweep(ctx context.Context) {
	for {
		for {
			n, err := r.st.SweepSent(ctx, r.o.retention, store.DefaultSweepBatch)
			if err != nil && ctx.Err() == nil {
				r.o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey outbox: sweeping sent messages failed; it is tried again", slog.Any("error", err))
			}
			if err != nil || n < store.DefaultSweepBatch {
				break
			}
		}
		if !sleep(ctx, time.Minute) {
			return
		}
	}
}
