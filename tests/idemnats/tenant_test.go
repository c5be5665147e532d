package idemnats_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/natstest"
)

// tenantHeader reads the tenant from the header "tenant".
var tenantHeader = consumer.WithMessageTenant(func(msg jetstream.Msg) (string, error) {
	if v := msg.Headers().Values("tenant"); len(v) == 1 && v[0] != "" {
		return v[0], nil
	}
	return "", errors.New("no tenant header")
})

// publishAs publishes body with Nats-Msg-Id id and the header tenant, and
// returns JetStream's acknowledgement.
func publishAs(t *testing.T, js jetstream.JetStream, subject, tenant, id, body string) *jetstream.PubAck {
	t.Helper()
	msg := nats.NewMsg(subject)
	msg.Data = []byte(body)
	msg.Header.Set(jetstream.MsgIDHeader, id)
	msg.Header.Set("tenant", tenant)
	ack, err := js.PublishMsg(t.Context(), msg)
	if err != nil {
		t.Fatal(err)
	}
	return ack
}

// TestTenantsCollideInDuplicateWindow: two tenants publish one Nats-Msg-Id
// with bodies of their own; JetStream stores the first and answers the
// second Duplicate, so no consumer ever sees it. consumer.New refuses a
// consumer on idemnats's Broker that scopes those ids by tenant, and names
// the fix, but neither tenant nor id.
func TestTenantsCollideInDuplicateWindow(t *testing.T) {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{MaxAge: time.Hour}) // the default window: 2 minutes
	subject := stream.CachedInfo().Config.Name + ".charges"
	acme, globex, id := natstest.Name("acme"), natstest.Name("globex"), natstest.Name("msg")

	first := publishAs(t, js, subject, acme, id, "acme's charge")
	if first.Duplicate {
		t.Fatal("the first tenant's message was taken for a duplicate")
	}
	second := publishAs(t, js, subject, globex, id, "globex's charge")
	if !second.Duplicate || second.Sequence != first.Sequence {
		t.Fatalf("the second tenant's publish: %+v, want JetStream to answer Duplicate with the first's sequence %d", second, first.Sequence)
	}
	info, err := stream.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	stored, err := stream.GetMsg(t.Context(), first.Sequence)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 || string(stored.Data) != "acme's charge" {
		t.Fatalf("the stream holds %d messages, the first %q; want only acme's: globex's is gone", info.State.Msgs, stored.Data)
	}

	name := natstest.Name("c")
	cons, err := stream.CreateConsumer(t.Context(), bounded(name))
	if err != nil {
		t.Fatal(err)
	}
	// WithHorizonWarning accepts a late redelivery, not this.
	eng := newEngine(t, memory.New(), engine.WithLogger(nil))
	opts := []consumer.Option{consumer.WithHorizonWarning(), consumer.WithDiscardDeadLetters(), tenantHeader}
	_, err = consumer.New(eng, name, newBroker(t, stream, cons), ok, opts...)
	var werr *idemnats.DuplicateWindowError
	if !errors.As(err, &werr) {
		t.Fatalf("New with a tenant function on a stream with a duplicate window: %v, want a DuplicateWindowError", err)
	}
	if werr.Consumer != name || werr.Stream != stream.CachedInfo().Config.Name || werr.Window != 2*time.Minute {
		t.Fatalf("error %+v, want consumer %s, stream %s, window 2m", werr, name, stream.CachedInfo().Config.Name)
	}
	msg := err.Error()
	t.Log(msg)
	for _, fix := range []string{"unique across tenants", "<tenant>/<id>", "consumer.WithMessageID(idemnats.UniqueMessageID)", "WithMessageID", "cannot be turned off"} {
		if !strings.Contains(msg, fix) {
			t.Errorf("the error does not say %q", fix)
		}
	}
	for _, secret := range []string{acme, globex, id} {
		if strings.Contains(msg, secret) {
			t.Errorf("the error quotes a message's tenant or id")
		}
	}

	// A mirror's window is 0: its origin stream dropped the messages.
	mirror := natstest.Name("M")
	m, err := js.CreateStream(t.Context(), jetstream.StreamConfig{Name: mirror, Mirror: &jetstream.StreamSource{Name: stream.CachedInfo().Config.Name}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.DeleteStream(context.Background(), mirror) })
	mcons, err := m.CreateConsumer(t.Context(), bounded(name))
	if err != nil {
		t.Fatal(err)
	}
	_, err = consumer.New(eng, name, newBroker(t, m, mcons), ok, opts...)
	if !errors.As(err, &werr) || werr.Window != 0 || !strings.Contains(err.Error(), "mirrors") {
		t.Fatalf("New with a tenant function on a mirror: %v, want a DuplicateWindowError that names the mirror", err)
	}
}

// TestTenantsWithUniqueMsgIDs: with the tenant in every Nats-Msg-Id, two
// tenants' messages of one order id are both stored and processed once
// each; their resends are dropped.
func TestTenantsWithUniqueMsgIDs(t *testing.T) {
	_, js := natstest.Connect(t)
	r := newRig(t, js, memory.New(), nil, nil, tenantHeader, consumer.WithMessageID(idemnats.UniqueMessageID))
	for _, tenant := range []string{"acme", "globex"} {
		if ack := publishAs(t, js, r.subject(), tenant, tenant+"/msg-X", tenant+"'s charge"); ack.Duplicate {
			t.Fatalf("%s's message was taken for a duplicate", tenant)
		}
	}
	r.consume(2)
	time.Sleep(150 * time.Millisecond) // past the stream's duplicate window
	r.publish("acme/msg-X", "acme's charge", "tenant", "acme")
	r.publish("globex/msg-X", "globex's charge", "tenant", "globex")
	r.consume(2)
	if r.runsOf("acme/msg-X") != 1 || r.runsOf("globex/msg-X") != 1 {
		t.Fatalf("runs %v, want each tenant's message once", r.runs)
	}
	if got := r.outcomes(); got[consumer.Processed] != 2 || got[consumer.Duplicate] != 2 {
		t.Fatalf("outcomes %v, want 2 processed and 2 duplicates", got)
	}
	r.settled()
}

// TestNewWithoutTenantUnchanged: without a tenant function JetStream's dedup
// and idemkey's agree, and consumer.New accepts a stream with a duplicate
// window, as it does a tenant function that reads its id from elsewhere, or
// from a Nats-Msg-Id unique across tenants (UniqueMessageID).
func TestNewWithoutTenantUnchanged(t *testing.T) {
	_, js := natstest.Connect(t)
	stream := natstest.Stream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	name := natstest.Name("c")
	cons, err := stream.CreateConsumer(t.Context(), bounded(name))
	if err != nil {
		t.Fatal(err)
	}
	eng := newEngine(t, memory.New())
	b := newBroker(t, stream, cons)
	discard := consumer.WithDiscardDeadLetters()
	for what, opts := range map[string][]consumer.Option{
		"no tenant function":                nil,
		"no tenant, WithMessageID":          {consumer.WithMessageID(idemnats.CloudEventsID)},
		"a tenant, ids from another header": {tenantHeader, consumer.WithMessageID(idemnats.CloudEventsID)},
		"a tenant, UniqueMessageID":         {tenantHeader, consumer.WithMessageID(idemnats.UniqueMessageID)},
	} {
		if _, err := consumer.New(eng, name, b, ok, append(opts, discard)...); err != nil {
			t.Errorf("New with %s: %v", what, err)
		}
	}
	// An explicit MessageID is the default's.
	var werr *idemnats.DuplicateWindowError
	if _, err := consumer.New(eng, name, b, ok, discard, tenantHeader, consumer.WithMessageID(idemnats.MessageID)); !errors.As(err, &werr) {
		t.Errorf("New with a tenant function and WithMessageID(MessageID): %v, want a DuplicateWindowError", err)
	}
}
