package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemkafka"
)

// kafkaPartitions is how many partitions the topic this command creates has.
const kafkaPartitions = 4

// kafkaSegment is how long a segment of the topic this command creates takes
// records (segment.ms): Kafka deletes a record with its segment, so a record
// may be read again for up to MaxStreamAge plus this.
const kafkaSegment = 24 * time.Hour

// consumeKafka consumes the Kafka topic in the group -name until ctx is
// done: one loop of polls, each record processed and committed on its own,
// or with -batch, each poll's records together.
func consumeKafka(ctx context.Context, cfg config, eng *engine.Engine, opts []consumer.Option, w *worker) error {
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(strings.Split(cfg.kafkaBrokers, ",")...),
		kgo.ClientID("idemkey-example-consumer"),
		kgo.ConsumerGroup(cfg.name), kgo.ConsumeTopics(cfg.topic),
		kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll(), // as idemkafka.New requires
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		// The eager range balancer, not kgo's default cooperative-sticky: on
		// kfake, a two-phase soak of batches in which a member's commit was
		// refused mid-rebalance once left two partitions unassigned for
		// minutes with cooperative-sticky, and not with range (see
		// docs/consumers.md). An eager rebalance revokes every partition at
		// once, after the poll in hand.
		kgo.Balancers(kgo.RangeBalancer()),
		kgo.SessionTimeout(cfg.kafkaSessionTimeout), kgo.HeartbeatInterval(max(cfg.kafkaSessionTimeout/10, 100*time.Millisecond)),
		kgo.WithLogger(kgoLogger{w.logger}),
	)
	if err != nil {
		return fmt.Errorf("kafka: %w", err)
	}
	// A poll holds the group's rebalances: closing leaves the group once
	// they are allowed.
	defer cl.CloseAllowingRebalance()
	if err := createTopic(ctx, cl, cfg.topic); err != nil {
		return err
	}
	b, err := idemkafka.New(ctx, cl, idemkafka.WithMaxAttempts(cfg.maxDeliver)) // 0 keeps its default
	if err != nil {
		return err
	}
	c, err := newConsumer(eng, cfg, opts, w, b,
		func(r *kgo.Record) (string, error) { return tenant(kafkaHeader(r, "tenant")) },
		func(r *kgo.Record) []byte { return r.Value },
	)
	if err != nil {
		return err
	}
	w.logger.Info("consuming", "topic", cfg.topic, "group", cfg.name, "batch", cfg.batch)
	// As in consumeNATS: a stop lets the poll in hand finish.
	work, endWork := workContext(ctx)
	defer endWork()
	for {
		// One at a time, a poll takes what the client holds; each record is
		// committed on its own.
		n, wait := 64, time.Duration(0)
		if cfg.batch > 1 {
			n, wait = cfg.batch, cfg.batchWait
		}
		rs, err := idemkafka.NextBatch(ctx, cl, n, wait)
		if ctx.Err() != nil {
			w.logger.Info("shutting down")
			return nil
		}
		if err != nil {
			return fmt.Errorf("kafka: poll: %w", err)
		}
		if cfg.batch > 1 {
			for i, res := range c.HandleBatch(work, rs) {
				w.log(res, "partition", rs[i].Partition, "offset", rs[i].Offset)
			}
		} else {
			for _, r := range rs {
				w.log(c.Handle(work, r), "partition", r.Partition, "offset", r.Offset)
			}
		}
		cl.AllowRebalance()
	}
}

// createTopic creates topic, unless it exists, with kafkaPartitions
// partitions whose records are kept MaxStreamAge, in segments of
// kafkaSegment.
func createTopic(ctx context.Context, cl *kgo.Client, topic string) error {
	retention := fmt.Sprint(MaxStreamAge.Milliseconds())
	segment := fmt.Sprint(kafkaSegment.Milliseconds())
	_, err := kadm.NewClient(cl).CreateTopic(ctx, kafkaPartitions, -1,
		map[string]*string{"retention.ms": &retention, "segment.ms": &segment}, topic)
	if err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		return fmt.Errorf("kafka: create topic %s: %w", topic, err)
	}
	return nil
}

// kafkaHeader returns the values of a record's header.
func kafkaHeader(r *kgo.Record, name string) []string {
	var values []string
	for _, h := range r.Headers {
		if h.Key == name {
			values = append(values, string(h.Value))
		}
	}
	return values
}

// kgoLogger logs kgo's lines (the group's joins, assignments and
// revocations, and its errors: never a record's contents) with the
// command's logger, kgo's info lines at Debug level.
type kgoLogger struct{ logger *slog.Logger }

func (l kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelInfo }

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lv := slog.LevelDebug
	switch level {
	case kgo.LogLevelError:
		lv = slog.LevelError
	case kgo.LogLevelWarn:
		lv = slog.LevelWarn
	}
	l.logger.Log(context.Background(), lv, "kafka: "+msg, keyvals...)
}
