package idemnats

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
)

// Handler processes one message. In atomic mode ctx carries the store's
// transaction (see consumer.WithAtomic); its error decides what becomes of
// the message (consumer.Handler).
type Handler func(ctx context.Context, msg jetstream.Msg) error

// Consumer processes the messages of one JetStream consumer with a Handler,
// once per message id (see consumer.Consumer), and acknowledges each as its
// outcome says.
type Consumer struct {
	core       *consumer.Consumer
	h          Handler
	opts       *options
	maxDeliver int // the consumer's max deliver; 0 or less: no limit
}

// New returns a Consumer that runs h for the messages of cons, a consumer of
// stream, with the idempotency of core. It reads both configurations and
// refuses (a *consumer.HorizonError) when core's records would expire while
// JetStream may still redeliver a message (for up to the stream's max age,
// and, while consumers run, up to max deliver times the longest wait between
// two deliveries; without either, for ever), unless core was built with
// consumer.WithHorizonWarning. It refuses (a *DuplicateWindowError)
// a tenant function (WithMessageTenant) with ids read from the Nats-Msg-Id
// header (MessageID), which JetStream deduplicates across tenants, unless
// WithMessageIDsUniqueAcrossTenants says that the producers keep them apart.
//
// It starts nothing: pass Handle to cons.Consume, or call it for each message
// that cons.Fetch or cons.Messages returns.
func New(ctx context.Context, core *consumer.Consumer, stream jetstream.Stream, cons jetstream.Consumer, h Handler, opts ...Option) (*Consumer, error) {
	si, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemnats: reading the stream's configuration: %w", err)
	}
	ci, err := cons.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemnats: reading the consumer's configuration: %w", err)
	}
	if ci.Config.AckPolicy != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("idemnats: consumer %q must acknowledge explicitly (AckExplicitPolicy), to be redelivered what it did not finish", ci.Name)
	}
	cfg := ci.Config
	cfg.Durable = ci.Name // named in the horizon, ephemeral ones too
	if err := core.CheckHorizon(ctx, redeliveryHorizon(si.Config, cfg, core.MaxBackoff())); err != nil {
		return nil, err
	}
	o := newOptions(opts)
	if err := o.checkDuplicateWindow(si.Config, ci.Name); err != nil {
		return nil, err
	}
	if o.deadLetter == nil && !core.DiscardsDeadLetters() {
		return nil, errNoDeadLetter
	}
	return &Consumer{core: core, h: h, opts: o, maxDeliver: cfg.MaxDeliver}, nil
}

// DuplicateWindowError is New's answer to a consumer that scopes message ids
// by tenant (WithMessageTenant) but reads them from the Nats-Msg-Id header
// (MessageID), on a stream that deduplicates that header: JetStream drops a
// message whose Nats-Msg-Id it stored within the stream's duplicate window,
// whichever the tenant, before any consumer sees it. A second tenant's
// message with a first one's id is acknowledged to its producer as a
// duplicate and never processed.
type DuplicateWindowError struct {
	Consumer string
	Stream   string
	// Window is the stream's duplicate window; 0 for a mirror, whose origin
	// stream dropped the messages within its own.
	Window time.Duration
}

func (e *DuplicateWindowError) Error() string {
	drops := fmt.Sprintf("stream %s drops a message whose Nats-Msg-Id it stored within its duplicate window (%s)", e.Stream, e.Window)
	if e.Window <= 0 {
		drops = fmt.Sprintf("stream %s mirrors a stream that drops a message whose Nats-Msg-Id it stored within its duplicate window", e.Stream)
	}
	return fmt.Sprintf("idemnats: consumer %q scopes message ids by tenant, but %s, whichever the tenant: "+
		"a tenant's message is lost when another's has its id. "+
		"Publish every Nats-Msg-Id unique across tenants, the tenant prefixed to the id (\"<tenant>/<id>\"), and say so with WithMessageIDsUniqueAcrossTenants; "+
		"or read a tenant's own id from another header with WithMessageID, and publish no Nats-Msg-Id or one unique across tenants "+
		"(the window cannot be turned off: a Duplicates of 0 is JetStream's default, 2 minutes)",
		e.Consumer, drops)
}

// checkDuplicateWindow returns a *DuplicateWindowError when two tenants'
// messages with one id would collide in stream's duplicate window: a tenant
// function, ids read from the Nats-Msg-Id header, no word that the producers
// keep them apart, and a window (every stream has one, of at least 100ms; a
// mirror's is its origin's). Without a tenant function JetStream and idemkey
// agree: JetStream drops only an id that idemkey, which scopes it by this
// consumer of the stream, would drop too.
func (o *options) checkDuplicateWindow(stream jetstream.StreamConfig, cons string) error {
	if o.tenant == nil || o.globalIDs || reflect.ValueOf(o.id).Pointer() != reflect.ValueOf(MessageID).Pointer() {
		return nil
	}
	if stream.Duplicates <= 0 && stream.Mirror == nil {
		return nil
	}
	return &DuplicateWindowError{Consumer: cons, Stream: stream.Name, Window: stream.Duplicates}
}

// redeliveryHorizon is how long JetStream may redeliver a message of stream to cons:
// at most the stream's max age, after which the message is gone, and, while
// consumers run, at most max deliver times the longest wait between two
// deliveries (the ack wait or its back-off, or a negative acknowledgement's
// delay of up to maxBackoff). Unbounded when neither is set: a stream
// without a max age and a consumer with an unlimited max deliver.
func redeliveryHorizon(stream jetstream.StreamConfig, cons jetstream.ConsumerConfig, maxBackoff time.Duration) consumer.Horizon {
	h := consumer.Horizon{Unbounded: true}
	if stream.MaxAge > 0 {
		h = consumer.Horizon{Bound: stream.MaxAge, Source: fmt.Sprintf("stream %s: max age", stream.Name)}
	}
	if cons.MaxDeliver > 0 {
		wait := max(cons.AckWait, maxBackoff)
		for _, b := range cons.BackOff {
			wait = max(wait, b)
		}
		d := time.Duration(math.MaxInt64) // where the product would overflow
		if wait <= 0 || int64(cons.MaxDeliver) <= math.MaxInt64/int64(wait) {
			d = time.Duration(cons.MaxDeliver) * wait
		}
		if h.Unbounded || d < h.Bound {
			h = consumer.Horizon{Bound: d, Source: fmt.Sprintf("consumer %s: max deliver %d × %s between deliveries", cons.Durable, cons.MaxDeliver, wait)}
		}
	}
	if h.Unbounded {
		h.Source = fmt.Sprintf("stream %s has no max age, and consumer %s no max deliver", stream.Name, cons.Durable)
	}
	h.Fix = fmt.Sprintf("set stream %s's MaxAge to at most the retention (a max deliver bounds it too, but gives up on a message that keeps failing, into the dead-letter hook)", stream.Name)
	return h
}

// Handle processes msg and acknowledges it as its outcome says: Process,
// then Settle. It returns the outcome, for a log line or a count.
func (c *Consumer) Handle(ctx context.Context, msg jetstream.Msg) consumer.Result {
	res := c.Process(ctx, msg)
	c.Settle(ctx, msg, res)
	return res
}

// Process decides what becomes of msg, running the handler unless its id
// was processed before or is in progress, without acknowledging it: Settle does. A message that
// ended in a final failure or was refused goes to the dead-letter hook
// (WithDeadLetter) here; if the hook fails, the Result's action is Nak.
func (c *Consumer) Process(ctx context.Context, msg jetstream.Msg) consumer.Result {
	return c.core.DeadLetter(ctx, c.process(ctx, msg), c.deadLetter(msg))
}

// errNoDeadLetter is New's answer to a consumer with nowhere to put a
// dead letter.
var errNoDeadLetter = errors.New("idemnats: a message that fails for good, is refused, or fails for now on its last delivery has nowhere to go: " +
	"give WithDeadLetter a hook that keeps it (a subject or a table of its own), " +
	"or build the consumer with consumer.WithDiscardDeadLetters() to acknowledge such messages and lose them, logged at Error level")

// deadLetter is the dead-letter hook for msg; nil without one.
func (c *Consumer) deadLetter(msg jetstream.Msg) func(context.Context, error) error {
	if c.opts.deadLetter == nil {
		return nil
	}
	return func(ctx context.Context, err error) error { return c.opts.deadLetter(ctx, msg, err) }
}

// Settle tells JetStream what Process decided for msg: Ack, NakWithDelay or
// Term. A failed acknowledgement is logged and left to JetStream, which
// redelivers the message after its ack wait; its redelivery is dropped as a
// duplicate.
func (c *Consumer) Settle(ctx context.Context, msg jetstream.Msg, res consumer.Result) {
	var err error
	switch res.Action {
	case consumer.Ack:
		err = msg.Ack()
	case consumer.Reject:
		err = msg.Term() // TermWithReason needs nats-server 2.10.4
	default:
		err = msg.NakWithDelay(res.Delay)
	}
	if err != nil {
		c.core.Warn(ctx, "acknowledging a message failed; JetStream redelivers it after its ack wait", err)
	}
}

func (c *Consumer) process(ctx context.Context, msg jetstream.Msg) consumer.Result {
	d, err := c.delivery(msg)
	if err != nil {
		return c.core.Refuse(ctx, err)
	}
	return c.core.Process(ctx, d, func(ctx context.Context) error { return c.h(ctx, msg) })
}

// delivery reads msg into a Delivery; an error refuses it.
func (c *Consumer) delivery(msg jetstream.Msg) (consumer.Delivery, error) {
	meta, err := msg.Metadata()
	if err != nil {
		return consumer.Delivery{}, fmt.Errorf("idemnats: not a JetStream message: %w", err)
	}
	id, err := c.opts.id(msg)
	if err != nil {
		return consumer.Delivery{}, err
	}
	var tenant string
	if c.opts.tenant != nil {
		if tenant, err = c.opts.tenant(msg); err != nil {
			return consumer.Delivery{}, err
		}
	}
	return consumer.Delivery{
		ID:          id,
		Tenant:      tenant,
		Body:        msg.Data(),
		Attempt:     int(min(meta.NumDelivered, 1<<20)),
		Redelivered: meta.NumDelivered > 1,
		Last:        c.maxDeliver > 0 && meta.NumDelivered >= uint64(c.maxDeliver),
		Sent:        meta.Timestamp, // when the stream stored it, on the server's clock
	}, nil
}

// MessageID is the default id of a message: its Nats-Msg-Id header, which
// JetStream also deduplicates within the stream's duplicate window, across
// tenants (see WithMessageTenant).
func MessageID(msg jetstream.Msg) (string, error) {
	return header(msg, jetstream.MsgIDHeader)
}

// CloudEventsID is the id of a CloudEvent in NATS's binary content mode: its
// ce-id header (WithMessageID(CloudEventsID)).
func CloudEventsID(msg jetstream.Msg) (string, error) {
	return header(msg, "ce-id")
}

// header returns the one value of header name, or an error that names the
// header, never its value.
func header(msg jetstream.Msg, name string) (string, error) {
	switch v := msg.Headers().Values(name); len(v) {
	case 0:
		return "", fmt.Errorf("%w: no %s header", consumer.ErrNoID, name)
	case 1:
		return v[0], nil
	default:
		return "", errors.New("idemnats: the message has " + name + " more than once")
	}
}
