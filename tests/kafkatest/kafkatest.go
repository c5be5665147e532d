// Package kafkatest gives tests a Kafka cluster: franz-go's kfake, an
// in-process fake that speaks Kafka's protocol, started for each test on
// loopback ports; or, when IDEMKEY_TEST_KAFKA names one (host:port, comma
// separated), a real cluster, on which each test makes topics of its own.
// No Kafka broker is installed on the machines that run the tests, so kfake
// is the default; a test never skips for want of a broker.
package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Brokers returns the seed brokers of a cluster for t: IDEMKEY_TEST_KAFKA's,
// or those of a kfake cluster of t's own, closed when t ends. A kfake cluster
// lives in the test's process: a test kills and restarts consumer processes
// against it, never the broker.
func Brokers(t testing.TB) []string {
	t.Helper()
	if addrs := os.Getenv("IDEMKEY_TEST_KAFKA"); addrs != "" {
		return strings.Split(addrs, ",")
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		t.Fatalf("start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c.ListenAddrs()
}

// Name returns a name no other test uses, for a topic or a group.
func Name(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}

// Client returns a client of brokers with opts, closed when t ends.
func Client(t testing.TB, brokers []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.CloseAllowingRebalance) // a test that failed mid-poll would block Close
	return cl
}

// GroupClient returns a client that consumes topics in group as idemkafka
// needs it to (offsets committed by hand, rebalances held during a poll),
// from the start of each partition, with opts; closed when t ends.
func GroupClient(t testing.TB, brokers []string, group string, topics []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	return Client(t, brokers, append([]kgo.Opt{
		kgo.ConsumerGroup(group), kgo.ConsumeTopics(topics...),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	}, opts...)...)
}

// Topic creates a topic with partitions and configs, named after prefix,
// deleted when t ends. configs default to a retention (with its segment
// time) of two days, within any consumer's retention of days.
func Topic(t testing.TB, brokers []string, prefix string, partitions int32, configs map[string]*string) string {
	t.Helper()
	name := Name(prefix)
	TopicNamed(t, brokers, name, partitions, configs)
	return name
}

// TopicNamed creates topic name, as Topic does.
func TopicNamed(t testing.TB, brokers []string, name string, partitions int32, configs map[string]*string) {
	t.Helper()
	if configs == nil {
		configs = Retention(24*time.Hour, 24*time.Hour)
	}
	adm := kadm.NewClient(Client(t, brokers))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := adm.CreateTopic(ctx, partitions, 1, configs, name); err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := adm.DeleteTopic(ctx, name); err != nil {
			t.Logf("delete topic %s: %v", name, err)
		}
	})
}

// Lag counts the records of topic that group has not committed.
func Lag(t testing.TB, brokers []string, group, topic string) int64 {
	t.Helper()
	ends, committed := offsets(t, brokers, group, topic)
	var lag int64
	for p, end := range ends {
		lag += end - committed[p]
	}
	return lag
}

// Committed counts the records of topic that group has committed.
func Committed(t testing.TB, brokers []string, group, topic string) int64 {
	t.Helper()
	_, committed := offsets(t, brokers, group, topic)
	var n int64
	for _, at := range committed {
		n += at
	}
	return n
}

// offsets returns the end offset of each partition of topic, and the offset
// group committed for it (0 for none).
func offsets(t testing.TB, brokers []string, group, topic string) (ends, committed map[int32]int64) {
	t.Helper()
	adm := kadm.NewClient(Client(t, brokers))
	listed, err := adm.ListEndOffsets(context.Background(), topic)
	if err != nil {
		t.Fatalf("end offsets of %s: %v", topic, err)
	}
	fetched, err := adm.FetchOffsets(context.Background(), group)
	if errors.Is(err, kerr.GroupIDNotFound) { // it has committed nothing yet
		fetched, err = nil, nil
	}
	if err != nil {
		t.Fatalf("offsets of group %s: %v", group, err)
	}
	ends, committed = map[int32]int64{}, map[int32]int64{}
	listed.Each(func(o kadm.ListedOffset) {
		ends[o.Partition] = o.Offset
		if c, ok := fetched.Lookup(topic, o.Partition); ok {
			committed[o.Partition] = c.At
		}
	})
	return ends, committed
}

// Retention is the configuration of a topic that keeps records for
// retention, in segments that take records for segment.
func Retention(retention, segment time.Duration) map[string]*string {
	r, s := ms(retention), ms(segment)
	return map[string]*string{"retention.ms": &r, "segment.ms": &s, "cleanup.policy": new("delete")}
}

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }
