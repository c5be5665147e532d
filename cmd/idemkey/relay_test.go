package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/idemnats"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/outbox"
	"github.com/idemkey/idemkey/store/postgres"
)

// natsURL is the shared test server's (as tests/natstest, which this module
// does not require: a published module requires no unpublished one).
func natsURL() string {
	if u := os.Getenv("IDEMKEY_TEST_NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// testStream makes a JetStream stream of the test's own on the shared
// server, taking the subjects "<name>.>", deleted when t ends. Where no
// server answers, t skips, except in CI, where it fails.
func testStream(t *testing.T) (js jetstream.JetStream, stream jetstream.Stream, name string) {
	t.Helper()
	nc, err := nats.Connect(natsURL(), nats.Timeout(5*time.Second))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no NATS server at %s (%v). CI needs one with JetStream: nats-server -a 127.0.0.1 -p 4222 -js -sd DIR", natsURL(), err)
		}
		t.Skipf("no NATS server at %s (%v)", natsURL(), err)
	}
	t.Cleanup(nc.Close)
	if js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 6)
	rand.Read(b)
	name = "RELAY_" + hex.EncodeToString(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if stream, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}}); err != nil {
		t.Fatalf("create stream: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
	})
	return js, stream, name
}

// syncBuffer is a bytes.Buffer that the relay may write while the test
// reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func TestRelayToNATS(t *testing.T) {
	url, schema, st := newStore(t)
	_, stream, subject := testStream(t)

	// 50 messages, written in one transaction as a handler would.
	ob, err := outbox.New(st)
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	var want []string
	ms := make([]outbox.Message, n)
	for i := range ms {
		id := fmt.Sprintf("relay-test-%02d", i)
		want = append(want, id)
		ms[i] = outbox.Message{ID: id, Destination: subject + ".charges", PartitionKey: fmt.Sprintf("p%d", i%5),
			Headers: map[string]string{"Seq": fmt.Sprint(i)}, Payload: []byte("charge " + id)}
	}
	ctx := context.Background()
	publishAll(t, schema, ob, ms)

	// The relay runs until its context ends, as main's does at SIGINT or
	// SIGTERM.
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	var stdout, stderr syncBuffer
	exited := make(chan int, 1)
	go func() {
		exited <- run(rctx, []string{"relay", "-broker", natsURL(), "-batch", "7", "-database-url", url, "-json"}, &stdout, &stderr)
	}()

	// Every message arrives once, with its id as Nats-Msg-Id, its headers and
	// its payload.
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	deadline := time.Now().Add(time.Minute)
	for len(got) < n && time.Now().Before(deadline) {
		select {
		case code := <-exited:
			t.Fatalf("relay exited %d before all messages arrived\nstderr:\n%s", code, stderr.String())
		default:
		}
		batch, err := cons.FetchNoWait(n)
		if err != nil {
			t.Fatal(err)
		}
		for m := range batch.Messages() {
			id := m.Headers().Get(nats.MsgIdHdr)
			got = append(got, id)
			if seq, _ := strconv.Atoi(m.Headers().Get("Seq")); id != fmt.Sprintf("relay-test-%02d", seq) {
				t.Errorf("message %s has header Seq %d", id, seq)
			}
			if string(m.Data()) != "charge "+id {
				t.Errorf("message %s has payload %q", id, m.Data())
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("the stream holds %d messages, want the %d written:\n got %v\nwant %v\nstderr:\n%s", len(got), n, got, want, stderr.String())
	}

	stop()
	select {
	case code := <-exited:
		if code != exitOK {
			t.Fatalf("relay exited %d after its context ended, want %d\nstderr:\n%s", code, exitOK, stderr.String())
		}
	case <-time.After(time.Minute):
		t.Fatal("relay did not exit within a minute of its context ending")
	}
	logs := stderr.String()
	for _, want := range []string{`"msg":"idemkey relay: started"`, `"broker":"nats"`, `"msg":"idemkey relay: stopped"`} {
		if !strings.Contains(logs, want) {
			t.Errorf("the relay's log has no %s:\n%s", want, logs)
		}
	}
	if !strings.Contains(stdout.String(), `"stopped": true`) {
		t.Errorf("stdout %q is not -json's result", stdout.String())
	}
	// All were marked sent: none is pending.
	if pending, _, err := st.PendingMessages(ctx); err != nil || pending != 0 {
		t.Errorf("PendingMessages: %d, %v; want 0 once all were sent", pending, err)
	}
}

func TestRelayUsage(t *testing.T) {
	url, _, _ := newStore(t)
	for _, tc := range []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"relay"}, "relay needs -broker"},
		{[]string{"relay", "-broker", "http://127.0.0.1:4222"}, `unknown scheme "http"`},
		{[]string{"relay", "-broker", "127.0.0.1:4222"}, "no scheme"},
		{[]string{"relay", "-broker", "kafka://127.0.0.1"}, "must be host:port"},
		{[]string{"relay", "-broker", "kafka://b1:9092,bob:" + unreachablePassword + "@b2:9092"}, "must be host:port"},
		{[]string{"relay", "-broker", "amqp://u:" + unreachablePassword + "%zz@h:5672/"}, "not a URL with a host"},
		{[]string{"relay", "-broker", "amqp://guest:" + unreachablePassword + "@/"}, "not a URL with a host"},
		{[]string{"relay", "-broker", "nats://127.0.0.1:4222", "-exchange", "x"}, "-exchange is for an amqp:// broker"},
		{[]string{"relay", "-broker", "nats://127.0.0.1:4222", "-batch", "0"}, "WithBatch(0)"},
		{[]string{"relay", "-broker", "nats://127.0.0.1:4222", "-lease", "10ms"}, "WithLease(10ms)"},
	} {
		_, stderr := mustRun(t, exitUsage, url, tc.args...)
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("idemkey %s: stderr %q does not say %q", strings.Join(tc.args, " "), stderr, tc.want)
		}
		if strings.Contains(tc.want, "scheme") && !strings.Contains(stderr, "nats://host:port") {
			t.Errorf("idemkey %s: stderr %q does not name the schemes -broker takes", strings.Join(tc.args, " "), stderr)
		}
		if strings.Contains(stderr, unreachablePassword) {
			t.Errorf("idemkey %s: stderr %q shows the broker's password", strings.Join(tc.args, " "), stderr)
		}
	}
}

// A broker that does not answer is its own exit code, and its password is
// never printed.
func TestRelayBrokerDown(t *testing.T) {
	url, _, _ := newStore(t)
	_, stderr := mustRun(t, exitBroker, url, "relay", "-broker", "amqp://guest:"+unreachablePassword+"@127.0.0.1:1/", "-timeout", "5s")
	if !strings.Contains(stderr, "cannot connect to the broker") || strings.Contains(stderr, unreachablePassword) {
		t.Errorf("stderr %q: want the broker named without its password", stderr)
	}
}

// A claim takes only the oldest unsent message of each partition, so a
// partition's backlog is drained one claim after another, never waiting for
// the poll interval (an hour here) between them.
func TestRelayDrainsAPartition(t *testing.T) {
	_, schema, st := newStore(t)
	js, stream, subject := testStream(t)
	ob, err := outbox.New(st)
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	ms := make([]outbox.Message, n)
	for i := range ms {
		ms[i] = outbox.Message{ID: fmt.Sprintf("drain-%02d", i), Destination: subject + ".one", PartitionKey: "one", Payload: []byte{byte(i)}}
	}
	ctx := context.Background()
	publishAll(t, schema, ob, ms)
	pub, err := idemnats.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := ob.Relay(pub, outbox.WithPollInterval(time.Hour), outbox.WithLogger(nil))
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); relay.Run(rctx) }()
	defer func() { stop(); <-done }()

	var got []byte
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); len(got) < n && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		batch, err := cons.FetchNoWait(n)
		if err != nil {
			t.Fatal(err)
		}
		for m := range batch.Messages() {
			got = append(got, m.Data()...)
		}
	}
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the stream holds %v, want the partition's %d messages in order %v", got, n, want)
	}
}

// publishAll writes ms to ob in one transaction on schema, as a handler
// would, and commits it.
func publishAll(t *testing.T, schema string, ob *outbox.Outbox, ms []outbox.Message) {
	t.Helper()
	ctx := context.Background()
	tx, err := pgtest.Pool(t, schema).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Publish(postgres.ContextWithTx(ctx, tx), ms...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}
