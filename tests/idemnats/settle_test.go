package idemnats_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/natstest"
)

// loseFirstSettle is a Broker whose first Settle fails without telling
// JetStream anything: an acknowledgement lost on its way.
type loseFirstSettle struct {
	consumer.Broker[jetstream.Msg]
	lost atomic.Bool
}

func (b *loseFirstSettle) Settle(ctx context.Context, msgs []jetstream.Msg, results []consumer.Result) error {
	if b.lost.CompareAndSwap(false, true) {
		return errors.New("nats: connection closed")
	}
	return b.Broker.Settle(ctx, msgs, results)
}

// TestLostAcknowledgement: a processed message whose acknowledgement is
// lost is delivered again by JetStream after its ack wait, and dropped as a
// duplicate: the handler runs once. The consumer logs the failure at Warn
// level, without the message's id or body.
func TestLostAcknowledgement(t *testing.T) {
	_, js := natstest.Connect(t)
	logger, logs := logtest.New()
	r := newWrappedRig(t, js, memory.New(), nil, func(b consumer.Broker[jetstream.Msg]) consumer.Broker[jetstream.Msg] {
		return &loseFirstSettle{Broker: b}
	}, []engine.Option{engine.WithLogger(logger)})
	r.publish("order-secret", "charge secret")
	r.consume(2) // the delivery whose Ack was lost, then its redelivery
	if n := r.runsOf("order-secret"); n != 1 {
		t.Fatalf("the handler ran %d times, want once", n)
	}
	if got := r.outcomes(); got[consumer.Processed] != 1 || got[consumer.Duplicate] != 1 {
		t.Fatalf("outcomes %v, want 1 processed, then 1 duplicate", got)
	}
	out := logs.String()
	warned := false
	for line := range strings.Lines(out) {
		warned = warned || strings.Contains(line, "level=WARN") && strings.Contains(line, "settling messages with the broker failed")
	}
	if !warned || strings.Contains(out, "secret") {
		t.Fatalf("want the lost acknowledgement logged at Warn level, without the message's id or body; logged:\n%s", out)
	}
	r.settled()
}
