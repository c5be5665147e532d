package outbox_test

import (
	"bytes"
	"context"
	"maps"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store/postgres"
)

// created is a message a charge handler publishes.
func created(payload string) outbox.Message {
	return outbox.Message{Destination: "payments.charge.created", Headers: map[string]string{"content-type": "application/json"},
		Payload: []byte(payload)}
}

// A handler's messages in an atomic call are written with its charge; their
// ids derive from the call's key and their place in the call, and their
// partition is the call's. The relay sends them as they were published.
func TestPublishInAtomicCall(t *testing.T) {
	r := newRig(t)
	a := r.serve(r.atomic, "order-1", r.charge(t, "ch_1", succeeded, created(`{"charge":"ch_1"}`), created(`{"charge":"ch_1","n":2}`)))
	if a.Verdict != engine.Executed {
		t.Fatalf("verdict %v, want executed", a.Verdict)
	}
	rows := r.rows(t)
	if len(rows) != 2 {
		t.Fatalf("the outbox holds %d messages, want 2", len(rows))
	}
	partition := idemkey.DeriveKey(tenant, opName, "order-1", "outbox messages")
	for i, x := range rows {
		want := idemkey.DeriveKey(tenant, opName, "order-1", "outbox message "+string(rune('1'+i)))
		if x.ID != want {
			t.Errorf("message %d: id %s, want DeriveKey(..., %q) = %s", i+1, x.ID, "outbox message "+string(rune('1'+i)), want)
		}
		if x.PartitionKey != partition {
			t.Errorf("message %d: partition %s, want the call's %s", i+1, x.PartitionKey, partition)
		}
		if x.Destination != "payments.charge.created" || x.Sent {
			t.Errorf("message %d: destination %q, sent %v", i+1, x.Destination, x.Sent)
		}
	}
	if n := r.count(t, `SELECT count(*) FROM charges`); n != 1 {
		t.Fatalf("%d charges, want 1", n)
	}

	// A replay runs nothing and publishes nothing.
	if a := r.serve(r.atomic, "order-1", r.charge(t, "ch_1", succeeded, created("x"))); a.Verdict != engine.Replayed {
		t.Fatalf("retry: verdict %v, want replayed", a.Verdict)
	}
	if n := len(r.rows(t)); n != 2 {
		t.Fatalf("after a replay the outbox holds %d messages, want 2", n)
	}

	var pub recorder
	start(t, r.relay(t, r.ob, &pub))
	waitFor(t, "two messages sent", func() bool { return len(pub.sent()) == 2 })
	for i, m := range pub.sent() {
		want := created(`{"charge":"ch_1"}`)
		if i == 1 {
			want = created(`{"charge":"ch_1","n":2}`)
		}
		if m.ID != rows[i].ID || m.PartitionKey != partition || m.Destination != want.Destination ||
			!bytes.Equal(m.Payload, want.Payload) || !maps.Equal(m.Headers, want.Headers) {
			t.Errorf("sent %d: %+v, want %+v with id %s", i, m, want, rows[i].ID)
		}
	}
	waitFor(t, "both marked sent", func() bool {
		rows := r.rows(t)
		return rows[0].Sent && rows[1].Sent
	})
}

// A message keeps the partition key its handler gave.
func TestPublishKeepsPartitionKey(t *testing.T) {
	r := newRig(t)
	m := created("p")
	m.PartitionKey = "customer-42"
	r.serve(r.atomic, "order-p", r.charge(t, "ch_p", succeeded, m))
	rows := r.rows(t)
	if len(rows) != 1 || rows[0].PartitionKey != "customer-42" ||
		rows[0].ID != idemkey.DeriveKey(tenant, opName, "order-p", "outbox message 1") {
		t.Fatalf("rows %+v, want one of partition customer-42 with the derived id", rows)
	}
}

// A message published with an ID of its own, in a call, is its own
// partition unless given one, and takes no place among the call's: the next
// message without an ID is still "outbox message 1".
func TestPublishWithOwnID(t *testing.T) {
	r := newRig(t)
	own := created("own")
	own.ID = "0190b6a4-7c3e-7d2a-9f10-2b3c4d5e6f71"
	r.serve(r.atomic, "order-own", r.charge(t, "ch_own", succeeded, own, created("made")))
	rows := r.rows(t)
	if len(rows) != 2 {
		t.Fatalf("the outbox holds %d messages, want 2", len(rows))
	}
	if rows[0].ID != own.ID || rows[0].PartitionKey != own.ID {
		t.Errorf("the message with its own id: id %s, partition %s; want %s for both", rows[0].ID, rows[0].PartitionKey, own.ID)
	}
	if want := idemkey.DeriveKey(tenant, opName, "order-own", "outbox message 1"); rows[1].ID != want ||
		rows[1].PartitionKey != idemkey.DeriveKey(tenant, opName, "order-own", "outbox messages") {
		t.Errorf("the message without an id: id %s, partition %s; want %s, the call's partition", rows[1].ID, rows[1].PartitionKey, want)
	}
}

// A handler whose call ends in an error leaves no message: a released error
// (Unavailable) rolls its whole transaction back, a recorded one (NotFound)
// its writes to the savepoint, keeping only the record.
func TestNoMessageWithoutCommit(t *testing.T) {
	for name, res := range map[string]engine.HandlerResult{"released": released, "recorded": recorded} {
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			a := r.serve(r.atomic, "order-"+name, r.charge(t, "ch_"+name, res, created("a"), created("b")))
			if a.Verdict != engine.Executed {
				t.Fatalf("verdict %v, want executed", a.Verdict)
			}
			if n := len(r.rows(t)); n != 0 {
				t.Errorf("the outbox holds %d messages, want none", n)
			}
			if n := r.count(t, `SELECT count(*) FROM charges`); n != 0 {
				t.Errorf("%d charges, want none", n)
			}
			// The recorded error is replayed; the released key runs again.
			a = r.serve(r.atomic, "order-"+name, r.charge(t, "ch_"+name, succeeded, created("a")))
			want := map[string]engine.Verdict{"released": engine.Executed, "recorded": engine.Replayed}[name]
			if a.Verdict != want {
				t.Errorf("retry: verdict %v, want %v", a.Verdict, want)
			}
		})
	}
}

// A two-phase handler commits its own transaction, with its messages, and
// then its key's record fails (the call is released, as when the engine's
// write fails or the process dies): the re-run publishes the same messages
// with the same ids, and the outbox keeps the first run's copy alone.
func TestRerunMakesTheSameIDs(t *testing.T) {
	r := newRig(t)
	runs := 0
	handler := func(ctx context.Context) engine.HandlerResult {
		runs++
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO charges (id) VALUES ('ch_2') ON CONFLICT DO NOTHING`); err != nil {
				return err
			}
			return r.ob.Publish(postgres.ContextWithTx(ctx, tx), created("one"), created("two"))
		})
		if err != nil {
			t.Errorf("run %d: %v", runs, err)
		}
		if runs == 1 {
			return released // committed, and then the record is lost
		}
		return succeeded
	}
	r.serve(r.twoPhase, "order-2", handler)
	first := r.rows(t)
	if a := r.serve(r.twoPhase, "order-2", handler); a.Verdict != engine.Executed || runs != 2 {
		t.Fatalf("re-run: verdict %v after %d runs, want executed after 2", a.Verdict, runs)
	}
	second := r.rows(t)
	if len(first) != 2 || len(second) != 2 {
		t.Fatalf("the outbox holds %d messages after the first run, %d after the second: want 2 and 2", len(first), len(second))
	}
	for i := range first {
		want := idemkey.DeriveKey(tenant, opName, "order-2", "outbox message "+string(rune('1'+i)))
		if first[i].ID != want || second[i].ID != want {
			t.Errorf("message %d: ids %s then %s, want %s", i+1, first[i].ID, second[i].ID, want)
		}
	}
}

// Outside a keyed call a message gets a random id, and is its own partition.
func TestPublishOutsideCall(t *testing.T) {
	r := newRig(t)
	r.publish(t, created("a"), created("b"))
	rows := r.rows(t)
	if len(rows) != 2 {
		t.Fatalf("the outbox holds %d messages, want 2", len(rows))
	}
	for i, x := range rows {
		if _, err := idemkey.ParseKey(x.ID); err != nil {
			t.Errorf("message %d: id %q is no key: %v", i+1, x.ID, err)
		}
		if x.PartitionKey != x.ID {
			t.Errorf("message %d: partition %s, want its id %s", i+1, x.PartitionKey, x.ID)
		}
	}
	if rows[0].ID == rows[1].ID {
		t.Errorf("two messages share the id %s", rows[0].ID)
	}
	// An id given is kept, and its copy is dropped.
	m := created("c")
	m.ID = "0190b6a4-7c3e-7d2a-9f10-2b3c4d5e6f70"
	r.publish(t, m)
	r.publish(t, m)
	if n := r.count(t, `SELECT count(*) FROM `+outboxTable+` WHERE id = '`+m.ID+`'`); n != 1 {
		t.Errorf("%d copies of a message published twice with its id, want 1", n)
	}
}

// Publish refuses what no broker takes, with an error that says why and
// never quotes the payload, and writes none of the messages it was given.
func TestPublishRefuses(t *testing.T) {
	const secret = "secret-payload-4242"
	ok := created(secret)
	big := created(strings.Repeat(secret, 100))
	for name, tc := range map[string]struct {
		ms     []outbox.Message
		nilTx  bool
		poolTx bool // the pool given as the transaction: each statement commits on its own
		want   string
	}{
		"no transaction":       {ms: []outbox.Message{ok}, nilTx: true, want: "transaction"},
		"pool as transaction":  {ms: []outbox.Message{ok}, poolTx: true, want: "transaction"},
		"id too long":          {ms: []outbox.Message{ok, {ID: strings.Repeat("k", 256), Destination: "d", Payload: []byte(secret)}}, want: "ID or a PartitionKey"},
		"id with NUL":          {ms: []outbox.Message{ok, {ID: "a\x00b", Destination: "d", Payload: []byte(secret)}}, want: "ID or a PartitionKey"},
		"partition not UTF-8":  {ms: []outbox.Message{ok, {Destination: "d", PartitionKey: "\xff\xfe", Payload: []byte(secret)}}, want: "ID or a PartitionKey"},
		"NATS's header":        {ms: []outbox.Message{ok, {Destination: "d", Headers: map[string]string{"Nats-Rollup": "sub"}, Payload: []byte(secret)}}, want: "NATS reserves"},
		"the id's header":      {ms: []outbox.Message{ok, {Destination: "d", Headers: map[string]string{"Message-ID": "x"}, Payload: []byte(secret)}}, want: "message-id"},
		"header name":          {ms: []outbox.Message{ok, {Destination: "d", Headers: map[string]string{"a:b": "v"}, Payload: []byte(secret)}}, want: "header's name"},
		"header value":         {ms: []outbox.Message{ok, {Destination: "d", Headers: map[string]string{"h": "a\nb"}, Payload: []byte(secret)}}, want: "header's value"},
		"empty destination":    {ms: []outbox.Message{ok, {Payload: []byte(secret)}}, want: "destination"},
		"destination spaced":   {ms: []outbox.Message{ok, {Destination: "payments charge", Payload: []byte(secret)}}, want: "without spaces"},
		"destination too long": {ms: []outbox.Message{{Destination: strings.Repeat("d", 256), Payload: []byte(secret)}}, want: "255 bytes"},
		"destination control":  {ms: []outbox.Message{{Destination: "a\x00b", Payload: []byte(secret)}}, want: "printable"},
		"too large":            {ms: []outbox.Message{ok, big}, want: "WithMaxMessageSize"},
	} {
		t.Run(name, func(t *testing.T) {
			r := newRig(t, outbox.WithMaxMessageSize(1000))
			tx, err := r.pool.Begin(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			ctx := postgres.ContextWithTx(t.Context(), tx)
			switch {
			case tc.nilTx:
				ctx = t.Context()
			case tc.poolTx:
				ctx = postgres.ContextWithTx(t.Context(), r.pool)
			}
			perr := r.ob.Publish(ctx, tc.ms...)
			if err := tx.Commit(t.Context()); err != nil {
				t.Fatal(err)
			}
			switch {
			case perr == nil:
				t.Fatal("Publish accepted it")
			case !strings.Contains(perr.Error(), tc.want):
				t.Errorf("error %q does not say %q", perr, tc.want)
			case strings.Contains(perr.Error(), secret):
				t.Errorf("error %q quotes the payload", perr)
			}
			if n := len(r.rows(t)); n != 0 {
				t.Errorf("the outbox holds %d messages, want none", n)
			}
		})
	}
	if _, err := outbox.New(nil); err == nil {
		t.Error("New(nil) accepted")
	}
}

// A message's headers and payload survive the body's encoding, whatever
// they hold.
func TestEncodeRoundTrip(t *testing.T) {
	for _, m := range []outbox.Message{
		{},
		{Payload: []byte("x")},
		{Headers: map[string]string{"": ""}},
		{Headers: map[string]string{"b": "2", "a": "1", "ü": strings.Repeat("v", 300)}, Payload: []byte{0, 1, 0xff}},
		{Headers: map[string]string{"k": "\x00\x01"}, Payload: bytes.Repeat([]byte{0x80}, 1<<12)},
	} {
		var got outbox.Message
		if err := outbox.Decode(outbox.Encode(m), &got); err != nil {
			t.Fatalf("%+v: %v", m, err)
		}
		if !maps.Equal(got.Headers, m.Headers) || !bytes.Equal(got.Payload, m.Payload) {
			t.Errorf("%+v came back as %+v", m, got)
		}
	}
	for _, b := range [][]byte{nil, {}, {0x02}, {0x01}, {0x01, 0x05}, {0x01, 0x01, 0x03, 'a'}, {0x01, 0x01, 0x01, 'a', 0x09}} {
		var m outbox.Message
		if err := outbox.Decode(b, &m); err == nil {
			t.Errorf("% x decoded to %+v", b, m)
		}
	}
}

// Decode never panics, and what it accepts encodes to a body that decodes
// to the same message.
func FuzzDecode(f *testing.F) {
	f.Add(outbox.Encode(outbox.Message{}))
	f.Add(outbox.Encode(outbox.Message{Headers: map[string]string{"a": "1", "b": ""}, Payload: []byte("payload")}))
	f.Add([]byte{0x01, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{0x01, 0x01, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m outbox.Message
		if err := outbox.Decode(b, &m); err != nil {
			return
		}
		var again outbox.Message
		if err := outbox.Decode(outbox.Encode(m), &again); err != nil {
			t.Fatalf("% x decoded, but its re-encoding does not: %v", b, err)
		}
		if !maps.Equal(again.Headers, m.Headers) || !bytes.Equal(again.Payload, m.Payload) {
			t.Fatalf("% x: %+v came back as %+v", b, m, again)
		}
	})
}
