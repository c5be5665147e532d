package idemtest_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/tbtest"
)

// deliveries are three charge messages, the last of a declined customer.
func deliveries() []consumer.Delivery {
	var ds []consumer.Delivery
	for i, customer := range []string{"cus_1", "cus_2", declined} {
		ds = append(ds, consumer.Delivery{ID: fmt.Sprintf("msg-%d", i), Body: []byte(customer), Attempt: 1})
	}
	return ds
}

// The redelivery chaos passes a correct consumer on every store, and
// catches a side effect before a final error in two-phase mode.
func TestConsumer(t *testing.T) {
	for _, kind := range backendKinds {
		for _, m := range []mistake{none, effectBeforeError} {
			t.Run(fmt.Sprintf("%s/mistake=%v", kind, m != none), func(t *testing.T) {
				b := openBackend(t, kind)
				eng, opts := newConsumer(b)
				r := tbtest.New(t)
				kit := idemtest.New(r, idemtest.Chaos{Effects: b.effects})
				results := kit.Process(t.Context(), eng, "charges", deliveries(), func(ctx context.Context, d consumer.Delivery) error {
					_, err := b.charge(ctx, string(d.Body), m, nil)
					if status.Convert(err).Message() == "card declined" {
						return consumer.Final(err)
					}
					return err
				}, opts...)
				for i, want := range []consumer.Outcome{consumer.Processed, consumer.Processed, consumer.Failed} {
					if results[i].Outcome != want {
						t.Errorf("message %d: %s, want %s", i+1, results[i].Outcome, want)
					}
				}
				if m == none || b.atomic {
					tbtest.WantPass(t, r)
					return
				}
				tbtest.WantFailure(t, r, "message 3 of 3: the message ended failed, yet left 1 effect(s): a side effect before an error", "In two-phase mode")
			})
		}
	}
}

// newConsumer is an engine of b's store for a consumer, and the consumer's
// options: atomic on postgres-atomic.
func newConsumer(b *backend) (*engine.Engine, []consumer.Option) {
	eng := grpctest.Must(engine.New(b.store, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(nil)))
	var opts []consumer.Option
	if b.atomic {
		opts = append(opts, consumer.WithAtomic())
	}
	return eng, opts
}

// In atomic mode a consumer whose handler writes through the pool is
// caught every time: each message is first delivered to a consumer that
// dies before its commit, whose transaction rolls back while the pool's
// write stays. In two-phase mode the pool is the place for its write, and
// it passes.
func TestConsumerPoolWrite(t *testing.T) {
	for _, kind := range backendKinds {
		t.Run(kind, func(t *testing.T) {
			b := openBackend(t, kind)
			r := tbtest.New(t)
			kit := idemtest.New(r, idemtest.Chaos{Effects: b.effects})
			eng, opts := newConsumer(b)
			results := kit.Process(t.Context(), eng, "charges", deliveries()[:2], func(ctx context.Context, d consumer.Delivery) error {
				_, err := b.charge(ctx, string(d.Body), poolWrite, nil)
				return err
			}, opts...)
			for i, res := range results {
				if res.Outcome != consumer.Processed {
					t.Errorf("message %d: %s, want processed", i+1, res.Outcome)
				}
			}
			if !b.atomic {
				tbtest.WantPass(t, r)
				return
			}
			tbtest.WantFailure(t, r, "message 1 of 2: one message, 2 effects", "message 2 of 2: one message, 2 effects",
				"died before its commit", "postgres.TxFromContext(ctx)", "not through the pool")
		})
	}
}

// A consumer whose handler makes its effect in a goroutine, after it
// returns, is named as that, not only as an effect counter that counts
// nothing. The goroutine makes its effect once the kit has counted the
// message's effects for the last time.
func TestConsumerEffectAfterReturn(t *testing.T) {
	b := openBackend(t, "postgres")
	var reads atomic.Int32
	effects := func(ctx context.Context) (int, error) {
		n, err := b.effects(ctx)
		if reads.Add(1) == 4 { // before and after each of the message's two rounds
			close(b.afterReply)
		}
		return n, err
	}
	r := tbtest.New(t)
	kit := idemtest.New(r, idemtest.Chaos{Effects: effects})
	eng, opts := newConsumer(b)
	kit.Process(t.Context(), eng, "charges", deliveries()[:1], func(ctx context.Context, d consumer.Delivery) error {
		_, err := b.charge(ctx, string(d.Body), effectAfterReply, nil)
		return err
	}, opts...)
	tbtest.WantFailure(t, r, "counted no effect", "after it returns, in a goroutine", "make the effect before the handler returns")
	b.late.Wait()
}

// A broker's message function among Process's options (here an id read
// from a string message) is refused at once, naming the option and what
// Process wants instead, rather than run a consumer it cannot build.
func TestConsumerBrokerOption(t *testing.T) {
	b := openBackend(t, "memory")
	eng, _ := newConsumer(b)
	r := tbtest.New(t)
	kit := idemtest.New(r, idemtest.Chaos{})
	ran := false
	func() {
		defer func() {
			if v := recover(); v != nil {
				if _, ok := v.(tbtest.Fatal); !ok {
					panic(v)
				}
			}
		}()
		kit.Process(t.Context(), eng, "charges", deliveries(), func(context.Context, consumer.Delivery) error {
			ran = true
			return nil
		}, consumer.WithMessageID(func(m string) (string, error) { return m, nil }))
	}()
	if ran {
		t.Error("Process ran the handler with a broker's message function among its options")
	}
	tbtest.WantFailure(t, r, "Process cannot build the consumer", "WithMessageID's function is a func(string) (string, error)", "the consumer's own options")
}
