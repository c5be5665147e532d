package idemkafka_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/busystore"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// TestLastAttemptWhileBusy: one id in two partitions, handled by two
// consumers of one client. The first record's run holds the id; the second
// record's last attempt (WithMaxAttempts(1)) finds it in progress, and must
// not leave it to that run, which then fails for now: it waits for the run
// to end, runs the handler itself once the id is released, and is
// committed. (The first record's own retry, an hour later, is cut short:
// its partition is set back to it, uncommitted.)
func TestLastAttemptWhileBusy(t *testing.T) {
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, brokers, "charges", 2, nil)
	group := kafkatest.Name("g")
	cl := kafkatest.GroupClient(t, brokers, group, []string{topic})
	st := busystore.New(memory.New())
	logger, logs := logtest.New()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the consumer's log:\n%s", logs)
		}
	})
	eopts := []engine.Option{engine.WithLogger(logger)}
	started, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	var runs atomic.Int32
	h := func(context.Context, *kgo.Record) error {
		if runs.Add(1) == 1 {
			close(started)
			<-release
			return errors.New("ledger unreachable")
		}
		return nil
	}
	first := mustConsumer(t, st, group, cl, h, eopts, []consumer.Option{consumer.WithBackoff(time.Hour, time.Hour)})
	last := mustConsumer(t, st, group, cl, h, eopts, []consumer.Option{fast}, idemkafka.WithMaxAttempts(1))
	prod := kafkatest.Client(t, brokers, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for p := range int32(2) {
		rec := &kgo.Record{Topic: topic, Partition: p, Value: []byte("charge"), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte("a")}}}
		if err := prod.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var rs []*kgo.Record
	for len(rs) < 2 {
		more, err := idemkafka.NextBatch(ctx, cl, 2, 0)
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, more...)
	}
	byPartition := map[int32]*kgo.Record{}
	for _, r := range rs {
		byPartition[r.Partition] = r
	}
	firstCtx, stopFirst := context.WithCancel(ctx)
	defer stopFirst()
	firstRes := make(chan consumer.Result, 1)
	go func() { firstRes <- first.Handle(firstCtx, byPartition[0]) }()
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the first record's run did not start")
	}
	lastRes := make(chan consumer.Result, 1)
	go func() { lastRes <- last.Handle(busystore.LastDelivery(ctx), byPartition[1]) }()
	select {
	case <-st.Busy():
	case <-ctx.Done():
		t.Fatal("the last attempt did not find the id in progress")
	}
	releaseOnce.Do(func() { close(release) }) // the first run fails for now
	if res := <-lastRes; res.Outcome != consumer.Processed || res.Action != consumer.Ack || res.DeadLetter {
		t.Fatalf("the last attempt: %v (err %v), want it processed and acknowledged", res, res.Err)
	}
	stopFirst()
	if res := <-firstRes; res.Outcome != consumer.Retry || res.Action != consumer.Nak {
		t.Fatalf("the first record: %v (err %v), want its retry cut short, unsettled", res, res.Err)
	}
	if n := runs.Load(); n != 2 {
		t.Fatalf("the handler ran %d times, want twice: the first run, then the last attempt's", n)
	}
	cl.AllowRebalance()
	if lag := groupLag(t, brokers, group, topic); lag != 1 {
		t.Fatalf("%d records uncommitted, want 1: the first, set back to, and not the last attempt's", lag)
	}
}
