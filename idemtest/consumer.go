package idemtest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/postgres"
)

// Process delivers ds, as an at-least-once broker may, to a consumer named
// name on eng with opts (consumer.New's own options, not a broker's message
// functions: the kit is the consumer's broker, whose messages are ds): every
// message twice, out of order, and once more after its handler's effect but
// before its acknowledgement. In atomic mode each message is first delivered
// to a consumer that dies before its commit, so that a write outside
// postgres.TxFromContext's transaction stands beside the next delivery's.
//
// It fails the test unless each message ran its handler once (the
// redelivery during its run Busy, the later one a Duplicate) and, with
// Chaos.Effects, a processed message left one effect and any other none. It
// returns the Results of the first deliveries, in the order of ds.
func (k *Kit) Process(ctx context.Context, eng *engine.Engine, name string, ds []consumer.Delivery, h func(ctx context.Context, d consumer.Delivery) error, opts ...consumer.Option) []consumer.Result {
	k.t.Helper()
	c, err := newKitConsumer(eng, name, opts)
	if err != nil {
		k.t.Fatalf("idemtest: Process cannot build the consumer (give it the consumer's own options: the deliveries stand for a broker's message functions, WithMessageID, WithMessageTenant and WithDeadLetter): %v", err)
		return nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls += len(ds)
	k.late(ctx)
	defer func() { k.lastOK = false }()
	msgs := make([]*message, len(ds))
	for i := len(ds) - 1; i >= 0; i-- {
		msgs[i] = k.deliverFirst(ctx, c, ds[i], h)
	}
	for _, m := range msgs {
		before, _ := k.effects(ctx)
		m.deliver(ctx, c, redelivery(m.d, m.d.Last), "redelivered after it was acknowledged", h)
		if after, ok := k.effects(ctx); ok && m.counted {
			m.effects += after - before
		}
	}
	results := make([]consumer.Result, len(ds))
	for i, m := range msgs {
		results[i] = m.deliveries[0].res
		if problems := m.problems(); len(problems) > 0 {
			k.t.Errorf("idemtest: message %d of %d: %s\n%s", i+1, len(ds), strings.Join(problems, "\nidemtest: "), m.table())
		} else {
			k.t.Logf("idemtest: message %d of %d ran once in %d deliveries\n%s", i+1, len(ds), len(m.deliveries), m.table())
		}
	}
	return results
}

// kitConsumer is a consumer whose broker is the kit: its messages are
// deliveries, each with the handler it runs.
type kitConsumer = consumer.Consumer[*kitMessage]

// kitMessage is one delivery of a message, and what its handler does.
type kitMessage struct {
	d   consumer.Delivery
	run func(ctx context.Context) error
}

// newKitConsumer is consumer.New's consumer named name, on eng with opts,
// of the kit's messages.
func newKitConsumer(eng *engine.Engine, name string, opts []consumer.Option) (*kitConsumer, error) {
	opts = append(slices.Clip(opts),
		consumer.WithMessageTenant(func(m *kitMessage) (string, error) { return m.d.Tenant, nil }),
		consumer.WithDeadLetter(func(context.Context, *kitMessage, error) error { return nil }), // the Result says so
	)
	return consumer.New(eng, name, kitBroker{}, func(ctx context.Context, m *kitMessage) error { return m.run(ctx) }, opts...)
}

// kitBroker is the kit as a consumer.Broker: it delivers what Process
// says, and settles nothing.
type kitBroker struct{}

func (kitBroker) System() string                                                 { return "idemtest" }
func (kitBroker) ID(m *kitMessage) (string, error)                               { return m.d.ID, nil }
func (kitBroker) Read(m *kitMessage) (consumer.Delivery, error)                  { return m.d, nil }
func (kitBroker) Settle(context.Context, []*kitMessage, []consumer.Result) error { return nil }
func (kitBroker) Horizons(time.Duration) []consumer.Horizon                      { return nil }

// handle delivers d to c, whose handler runs h.
func handle(ctx context.Context, c *kitConsumer, d consumer.Delivery, h func(ctx context.Context) error) consumer.Result {
	return c.Handle(ctx, &kitMessage{d: d, run: h})
}

// message is one message's deliveries under Process, and its effects.
type message struct {
	d          consumer.Delivery
	counted    bool // Chaos.Effects counted effects
	effects    int
	during     int // the index of the delivery during the first run's handler; 0: none
	deliveries []delivery
	// died is the delivery before the first, to a consumer that dies before
	// its commit (atomic mode), whose transaction rolled back; nil in
	// two-phase mode.
	died *delivery
}

// delivery is one delivery of a message: what it was, what became of it,
// and whether it ran the handler.
type delivery struct {
	role string
	res  consumer.Result
	ran  bool
}

// deliverFirst delivers d, and delivers it again while its handler
// returns, after the handler's effect and before the acknowledgement.
func (k *Kit) deliverFirst(ctx context.Context, c *kitConsumer, d consumer.Delivery, h func(context.Context, consumer.Delivery) error) *message {
	m := &message{d: d}
	var before int
	before, m.counted = k.effects(ctx)
	m.died = dieBeforeCommit(ctx, c, d, h)
	m.deliveries = append(m.deliveries, delivery{role: "first delivery"})
	m.deliveries[0].res = handle(ctx, c, d, func(hctx context.Context) error {
		m.deliveries[0].ran = true
		err := h(hctx, d)
		// Not the last delivery: that one would wait for this run, which
		// waits for it.
		m.during = len(m.deliveries)
		m.deliver(ctx, c, redelivery(d, false), "redelivered during its handler, before its ack", h)
		return err
	})
	if after, ok := k.effects(ctx); ok && m.counted {
		m.effects = after - before
	}
	return m
}

// died is the panic with which a consumer "dies" before its commit: the
// engine releases the message's id whatever the consumer's classification.
type died struct{}

// dieBeforeCommit delivers d to a consumer that dies before its commit; in
// two-phase mode, where no transaction undoes an effect, it returns nil.
func dieBeforeCommit(ctx context.Context, c *kitConsumer, d consumer.Delivery, h func(context.Context, consumer.Delivery) error) (out *delivery) {
	dd := &delivery{role: "delivered before the first to a consumer that dies before its commit (atomic mode): its transaction rolled back"}
	defer func() {
		if v := recover(); v != nil {
			if _, ok := v.(died); !ok {
				panic(v)
			}
		}
	}()
	handle(ctx, c, d, func(hctx context.Context) error {
		if _, ok := postgres.TxFromContext(hctx); ok {
			out = dd
			dd.ran = true
			h(hctx, d)
		}
		panic(died{})
	})
	return out
}

// deliver delivers d as role, and records what became of it.
func (m *message) deliver(ctx context.Context, c *kitConsumer, d consumer.Delivery, role string, h func(context.Context, consumer.Delivery) error) {
	i := len(m.deliveries)
	m.deliveries = append(m.deliveries, delivery{role: role})
	res := handle(ctx, c, d, func(hctx context.Context) error {
		m.deliveries[i].ran = true
		return h(hctx, d)
	})
	m.deliveries[i].res = res
}

// redelivery is d as the broker delivers it again.
func redelivery(d consumer.Delivery, last bool) consumer.Delivery {
	d.Redelivered, d.Last = true, last
	if d.Attempt > 0 {
		d.Attempt++
	}
	return d
}

// problems says what is wrong with m's deliveries and effects.
func (m *message) problems() []string {
	var out []string
	ran, processed := 0, false
	for _, d := range m.deliveries {
		if d.ran {
			ran++
		}
		processed = processed || d.res.Outcome == consumer.Processed
	}
	first := m.deliveries[0].res
	retried := first.Outcome == consumer.Retry // a redelivery runs it again, as it should
	if ran > 1 && !retried {
		out = append(out, fmt.Sprintf("the handler ran %d times: a redelivery ran it again where it should have been Busy (during the first run) or a Duplicate (after it)", ran))
	}
	switch {
	case m.during == 0:
		out = append(out, fmt.Sprintf("the first delivery did not run the handler: it was %s", first.Outcome))
	case !retried && m.deliveries[m.during].res.Outcome != consumer.Busy:
		out = append(out, fmt.Sprintf("the redelivery during the first run's handler was %s, not busy: the first run did not hold the message's id", m.deliveries[m.during].res.Outcome))
	}
	if !m.counted {
		return out
	}
	switch {
	case processed && m.effects == 0:
		out = append(out, "the message was processed, yet Chaos.Effects counted no effect. Either Effects does not count this handler's effects (count what it makes: its rows, the calls a fake provider got), or the handler makes its effect after it returns, in a goroutine it does not wait for, which the message's record does not cover: make the effect before the handler returns")
	case processed && m.effects > 1 && m.died != nil:
		out = append(out, fmt.Sprintf("one message, %d effects: it took effect more than once. Its delivery to a consumer that died before its commit rolled back the message's transaction, yet its effect stayed: in atomic mode the handler writes outside the message's transaction, through the pool or another connection. Write through the transaction of postgres.TxFromContext(ctx), not through the pool, so that its writes commit with the message's record or not at all (an effect in another system needs two-phase mode)", m.effects))
	case processed && m.effects > 1 && retried:
		out = append(out, fmt.Sprintf("one message, %d effects: it took effect more than once. Its first delivery made its effect and then returned a transient error (%s), which releases the id, so the redelivery ran the handler again. Once the effect is made, return nil, or undo it before failing; in atomic mode, write through postgres.TxFromContext, whose writes a transient error rolls back", m.effects, first.Outcome))
	case processed && m.effects > 1:
		out = append(out, fmt.Sprintf("one message, %d effects: it took effect more than once, though its handler ran once: the handler makes more than one effect per message, or Effects counts more than this test's messages", m.effects))
	case !processed && m.effects > 0:
		out = append(out, fmt.Sprintf("the message ended %s, yet left %d effect(s): a side effect before an error. A final error is recorded (the message is dead-lettered) while its effect stands, and a transient one makes a redelivery run it again. In two-phase mode, return nil once the effect is made (or undo it before failing); in atomic mode, write through postgres.TxFromContext, whose writes an error rolls back", first.Outcome, m.effects))
	}
	return out
}

// table is the report of m's deliveries, one line each.
func (m *message) table() string {
	var b strings.Builder
	if m.died != nil {
		fmt.Fprintf(&b, "\tdelivery 0 (%s): ran the handler\n", m.died.role)
	}
	for i, d := range m.deliveries {
		ran := "did not run the handler"
		if d.ran {
			ran = "ran the handler"
		}
		fmt.Fprintf(&b, "\tdelivery %d (%s): %s, %s, %s\n", i+1, d.role, d.res.Outcome, d.res.Action, ran)
	}
	if m.counted {
		fmt.Fprintf(&b, "\teffects counted: %d\n", m.effects)
	}
	return b.String()
}
