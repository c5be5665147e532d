package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/internal/hooklog"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// A consumer whose process dies after a batch was processed and before its
// offsets were committed (a crash, which its Broker's Settle never saw)
// leaves the batch to the next client of the group, which drops every
// record as a duplicate: each ran once.
func TestRestartBeforeCommit(t *testing.T) {
	r := newRig(t, memory.New(), nil, nil, nil)
	const n = 20
	for i := range n {
		r.publish(fmt.Sprint("id-", i), fmt.Sprint("charge ", i))
	}
	b, err := idemkafka.New(t.Context(), r.cl)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := engine.New(r.st, engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		t.Fatal(err)
	}
	crashed, err := consumer.New(eng, r.group, crashBeforeSettle{b}, r.handle, fast, consumer.WithDiscardDeadLetters())
	if err != nil {
		t.Fatal(err)
	}
	for _, res := range crashed.HandleBatch(t.Context(), takeBatch(t, r, n)) {
		if res.Outcome != consumer.Processed {
			t.Fatalf("first client: %+v, want processed", res)
		}
	}
	r.cl.CloseAllowingRebalance() // the process is gone: nothing committed
	if lag := groupLag(t, r.brokers, r.group, r.topic); lag != n {
		t.Fatalf("%d records uncommitted after the first client, want %d", lag, n)
	}

	r.cl = kafkatest.GroupClient(t, r.brokers, r.group, []string{r.topic})
	r.c = mustConsumer(t, r.st, r.group, r.cl, func(context.Context, *kgo.Record) error {
		t.Error("the second client ran a handler")
		return nil
	}, nil, []consumer.Option{fast})
	got := map[consumer.Outcome]int{}
	for _, res := range r.c.HandleBatch(t.Context(), takeBatch(t, r, n)) {
		got[res.Outcome]++
	}
	r.cl.AllowRebalance()
	if got[consumer.Duplicate] != n {
		t.Fatalf("second client's outcomes %v, want %d duplicates", got, n)
	}
	for i := range n {
		if runs := r.runsOf(fmt.Sprint("id-", i)); runs != 1 {
			t.Fatalf("record id-%d ran %d times, want once", i, runs)
		}
	}
	r.settled()
}

// crashBeforeSettle is a Broker whose process dies once its records are
// processed, before it settles them: its Settle commits nothing.
type crashBeforeSettle struct {
	consumer.Broker[*kgo.Record]
}

func (crashBeforeSettle) Settle(context.Context, []*kgo.Record, []consumer.Result) error { return nil }

// MaxAttempts is the Broker's: Kafka's records are tried again in process.
func (b crashBeforeSettle) MaxAttempts() int {
	return b.Broker.(interface{ MaxAttempts() int }).MaxAttempts()
}

// A record produced with a timestamp longer ago than the retention, whose
// id has no record, is dead-lettered with consumer.ErrExpired and
// committed without running.
func TestExpired(t *testing.T) {
	r := newRig(t, memory.New(), nil, []engine.Option{engine.WithLogger(nil)}, nil)
	rec := r.record("a", "charge 1")
	rec.Timestamp = time.Now().Add(-8 * 24 * time.Hour) // the producer's CreateTime
	if err := r.prod.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
		t.Fatal(err)
	}
	r.consume(1)
	if got := r.outcomes(); got[consumer.Rejected] != 1 || r.runsOf("a") != 0 {
		t.Fatalf("outcomes %v and %d runs; want 1 refused and none", got, r.runsOf("a"))
	}
	if dead := r.deadLetters(); len(dead) != 1 || !errors.Is(dead[0], consumer.ErrExpired) {
		t.Fatalf("dead letters %v, want one with ErrExpired", dead)
	}
	r.settled()
}

// TestHooks: a record produced three times runs one execution and two
// replays, each before its offset is committed; its id reused with another
// body runs a refusal; a panicking hook changes no outcome and logs neither
// id nor tenant.
func TestHooks(t *testing.T) {
	var hooks hooklog.Log
	logger, logs := logtest.New()
	tenant := consumer.WithMessageTenant(func(*kgo.Record) (string, error) { return "tenant-secret", nil })
	r := newRig(t, memory.New(), nil, []engine.Option{engine.WithHooks(hooks.Hooks()), engine.WithLogger(logger)}, []consumer.Option{tenant})
	for _, panics := range []bool{false, true} {
		hooks.Panics.Store(panics)
		id := fmt.Sprint("order-secret-", panics)
		for range 3 {
			r.publish(id, "charge 100")
		}
		r.publish(id, "charge 200")
		r.consume(4)
		hooks.Want(t,
			"execute executed ack tenant-secret/"+id+" 9",
			"replay replayed ack tenant-secret/"+id+" 9",
			"replay replayed ack tenant-secret/"+id+" 9",
			"refuse reused reject tenant-secret/"+id+" 0")
	}
	if got := r.outcomes(); got[consumer.Processed] != 2 || got[consumer.Duplicate] != 4 || got[consumer.Rejected] != 2 {
		t.Errorf("outcomes %v, want 2 processed, 4 duplicates and 2 refused, with a panicking hook or not", got)
	}
	if out := logs.String(); !strings.Contains(out, "hook panicked") || strings.Contains(out, "secret") {
		t.Errorf("want the hook's panics logged, without the record's id or tenant; logged:\n%s", out)
	}
	r.settled()
}
