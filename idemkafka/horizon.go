package idemkafka

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
)

// readHorizons reads the configuration of each of topics and returns how
// long after a record is first processed Kafka may deliver it again
// (redeliveryHorizon), for each topic.
func readHorizons(ctx context.Context, cl *kgo.Client, topics []string) ([]consumer.Horizon, error) {
	// kadm.Client.Close would close cl: the admin client is left as it is.
	rcs, err := kadm.NewClient(cl).DescribeTopicConfigs(ctx, topics...)
	if err != nil {
		return nil, fmt.Errorf("idemkafka: reading the topics' configuration: %w", err)
	}
	horizons := make([]consumer.Horizon, 0, len(topics))
	for _, topic := range topics {
		rc, err := rcs.On(topic, nil)
		if err == nil {
			err = rc.Err
		}
		if err != nil {
			return nil, fmt.Errorf("idemkafka: reading topic %s's configuration: %w", topic, err)
		}
		cfg := map[string]string{}
		for _, c := range rc.Configs {
			if c.Value != nil {
				cfg[c.Key] = *c.Value
			}
		}
		h, err := redeliveryHorizon(topic, cfg)
		if err != nil {
			return nil, err
		}
		horizons = append(horizons, h)
	}
	return horizons, nil
}

// redeliveryHorizon is how long Kafka may deliver a record of topic, whose
// configuration is cfg, again: while it is in the log, as a group whose
// offsets are reset, or lost, or that a rebalance hands a partition whose
// commit lagged, reads it again. A record is deleted with its segment, once
// the segment's newest record is older than retention.ms; the segment
// takes records for up to segment.ms before it is closed. So the horizon is
// retention.ms plus segment.ms; unbounded when retention.ms is -1, or
// cleanup.policy compacts without deleting (a key's last record is kept
// for ever). Kafka's defaults: 7 days each, delete.
func redeliveryHorizon(topic string, cfg map[string]string) (consumer.Horizon, error) {
	fix := fmt.Sprintf("set topic %s's retention.ms and segment.ms to at most the retention together "+
		"(kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config retention.ms=...,segment.ms=...), with cleanup.policy delete", topic, topic)
	policy := cfg["cleanup.policy"]
	if policy == "" {
		policy = "delete"
	}
	if !strings.Contains(policy, "delete") {
		return consumer.Horizon{Unbounded: true, Source: fmt.Sprintf("topic %s: cleanup.policy %s keeps a key's last record for ever", topic, policy), Fix: fix}, nil
	}
	retention, err := millis(cfg, "retention.ms", 7*24*time.Hour)
	if err != nil {
		return consumer.Horizon{}, fmt.Errorf("idemkafka: topic %s: %w", topic, err)
	}
	if retention < 0 {
		return consumer.Horizon{Unbounded: true, Source: fmt.Sprintf("topic %s: retention.ms -1 keeps records for ever", topic), Fix: fix}, nil
	}
	segment, err := millis(cfg, "segment.ms", 7*24*time.Hour)
	if err != nil {
		return consumer.Horizon{}, fmt.Errorf("idemkafka: topic %s: %w", topic, err)
	}
	bound := time.Duration(math.MaxInt64) // where the sum would overflow
	if retention <= bound-max(segment, 0) {
		bound = retention + max(segment, 0)
	}
	return consumer.Horizon{
		Bound:  bound,
		Source: fmt.Sprintf("topic %s: retention.ms %s, plus segment.ms %s for which its last segment takes records", topic, retention, segment),
		Fix:    fix,
	}, nil
}

// millis reads cfg's key as milliseconds, or def when it is not there.
func millis(cfg map[string]string, key string, def time.Duration) (time.Duration, error) {
	v, ok := cfg[key]
	if !ok || v == "" {
		return def, nil
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s %q is not a number of milliseconds", key, v)
	}
	if ms < 0 {
		return -1, nil
	}
	if ms > math.MaxInt64/int64(time.Millisecond) {
		return time.Duration(math.MaxInt64), nil
	}
	return time.Duration(ms) * time.Millisecond, nil
}
