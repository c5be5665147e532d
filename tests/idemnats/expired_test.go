package idemnats_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/natstest"
)

// TestExpired: a message that JetStream stored longer ago than the
// consumer's retention, and whose id has no record, is dead-lettered with
// consumer.ErrExpired and terminated without running. The retention is a
// second (and so is the longest lease, which the retention must outlast),
// and the message is consumed after more than that.
func TestExpired(t *testing.T) {
	_, js := natstest.Connect(t)
	const retention = time.Second
	r := newRig(t, js, memory.New(), nil, []engine.Option{engine.WithRetention(retention), engine.WithMaxLease(retention),
		engine.WithClockSkew(0), engine.WithLogger(nil)}, consumer.WithHorizonWarning())
	r.publish("a", "charge 1")
	time.Sleep(retention + 100*time.Millisecond) // JetStream's clock stamped it; both clocks are this machine's
	r.consume(1)
	if got := r.outcomes(); got[consumer.Rejected] != 1 || r.runsOf("a") != 0 {
		t.Fatalf("outcomes %v and %d runs; want 1 refused and none", got, r.runsOf("a"))
	}
	if len(r.dead) != 1 || !errors.Is(r.dead[0], consumer.ErrExpired) {
		t.Fatalf("dead letters %v, want one with ErrExpired", r.dead)
	}
	r.settled()
}
