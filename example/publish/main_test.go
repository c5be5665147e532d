package main

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/tests/natstest"
)

// TestTenantsShareAnID: acme and globex publish one -id with bodies of their
// own, within the stream's duplicate window; JetStream stores both, since
// each Nats-Msg-Id names its tenant.
func TestTenantsShareAnID(t *testing.T) {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{MaxAge: time.Hour}) // the default window: 2 minutes
	subject := stream.CachedInfo().Config.Name + ".charges"
	for _, tenant := range []string{"acme", "globex"} {
		if err := publish(natstest.URL(), "", subject, "", "order-1001", tenant, 1, []byte(tenant+"'s charge")); err != nil {
			t.Fatal(err)
		}
	}
	for seq, tenant := range map[uint64]string{1: "acme", 2: "globex"} {
		msg, err := stream.GetMsg(t.Context(), seq)
		if err != nil {
			t.Fatalf("message %d: %v; want %s's, which JetStream must not drop as a duplicate", seq, err, tenant)
		}
		if got := msg.Header.Get(jetstream.MsgIDHeader); got != tenant+"/order-1001" || string(msg.Data) != tenant+"'s charge" {
			t.Errorf("message %d: Nats-Msg-Id %q, body %q; want %s's", seq, got, msg.Data, tenant)
		}
	}
}
