package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/tests/kafkatest"
)

// A member that holds a poll past the group's rebalance timeout, while a
// second member joins, is removed from the group, and its partition given
// to the second. When its record's handler then returns, its commit is
// refused: the member that lost the partition acknowledges nothing of it.
// The new owner gets the record again, and drops it as a duplicate: it ran
// once, and every offset ends committed, by the new owner.
func TestRevokedPartitionNotCommitted(t *testing.T) {
	brokers := kafkatest.Brokers(t)
	topic := kafkatest.Topic(t, brokers, "charges", 1, nil)
	group := kafkatest.Name("g")
	st := memory.New() // shared by both members, as a database would be
	logger, logs := logtest.New()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the consumers' log:\n%s", logs)
		}
	})
	var mu sync.Mutex
	runs := map[string]int{}
	held, release := make(chan struct{}), make(chan struct{})
	var holdOnce sync.Once
	h := func(_ context.Context, rec *kgo.Record) error {
		mu.Lock()
		runs[string(rec.Value)]++
		mu.Unlock()
		if string(rec.Value) == "held" {
			holdOnce.Do(func() { close(held); <-release })
		}
		return nil
	}
	// The eager protocol (range): a rebalance revokes every partition first,
	// which the held poll blocks, so the coordinator removes the member.
	member := func(name string) (*kgo.Client, *kafkaConsumer) {
		cl := kafkatest.GroupClient(t, brokers, group, []string{topic}, kgo.ClientID(name),
			kgo.Balancers(kgo.RangeBalancer()), kgo.RebalanceTimeout(time.Second), kgo.HeartbeatInterval(100*time.Millisecond))
		return cl, mustConsumer(t, st, group, cl, h, []engine.Option{engine.WithLogger(logger)}, []consumer.Option{fast})
	}
	prod := kafkatest.Client(t, brokers)
	for _, v := range []string{"before", "held", "after"} {
		rec := &kgo.Record{Topic: topic, Value: []byte(v), Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(v)}}}
		if err := prod.ProduceSync(t.Context(), rec).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}

	clA, a := member("a")
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	resA := make(chan []consumer.Result, 1)
	go func() {
		var rs []*kgo.Record
		for len(rs) < 3 {
			more, err := idemkafka.NextBatch(ctx, clA, 10, 0)
			if err != nil {
				resA <- nil
				return
			}
			rs = append(rs, more...)
		}
		var results []consumer.Result
		for _, rec := range rs {
			results = append(results, a.Handle(context.Background(), rec))
		}
		resA <- results
		clA.AllowRebalance()
	}()
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("member a never ran the held record")
	}
	clB, b := member("b")
	adm := kadm.NewClient(kafkatest.Client(t, brokers))
	for only := false; !only; time.Sleep(20 * time.Millisecond) {
		if ctx.Err() != nil {
			t.Fatal("member a was never removed from the group")
		}
		gs, err := adm.DescribeGroups(ctx, group)
		if err != nil {
			continue
		}
		g := gs[group]
		only = g.State == "Stable" && len(g.Members) == 1 && g.Members[0].ClientID == "b"
	}
	close(release)
	results := <-resA
	// Member a is done: it leaves, rather than rejoin the group once its
	// rebalance is allowed and take the partition back from b, which
	// would then never get the records it is waiting for.
	clA.LeaveGroup()
	if len(results) != 3 || results[1].Outcome != consumer.Processed || !errors.Is(results[2].Err, idemkafka.ErrRewound) {
		t.Fatalf("member a's results %v, want the held record processed, and the one after it skipped once its commit was refused", results)
	}
	if !strings.Contains(logs.String(), "settling messages with the broker failed") {
		t.Fatalf("member a's commit after it lost the partition was not refused (logged as a failed settle)")
	}
	if lag := groupLag(t, brokers, group, topic); lag != 2 {
		t.Fatalf("%d records uncommitted once member a settled, want 2: a committed only what it settled before it lost the partition", lag)
	}

	// Member b now takes the held record and the one after it.
	var got []string
	for len(got) < 2 {
		rs, err := idemkafka.NextBatch(ctx, clB, 10, 0)
		if err != nil {
			t.Fatalf("member b: %v (took %v)", err, got)
		}
		for i, res := range b.HandleBatch(context.Background(), rs) {
			got = append(got, fmt.Sprintf("%s:%s", rs[i].Value, res.Outcome))
		}
		clB.AllowRebalance()
	}
	if fmt.Sprint(got) != "[held:duplicate after:processed]" {
		t.Fatalf("member b: %v, want the held record dropped as a duplicate, the next processed", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(runs) != "map[after:1 before:1 held:1]" {
		t.Fatalf("runs %v, want each record once", runs)
	}
	settled(t, brokers, group, topic)
}
