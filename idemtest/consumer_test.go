package idemtest_test

import (
	"context"
	"fmt"
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
				eng := grpctest.Must(engine.New(b.store, engine.WithRetention(consumer.RecommendedRetention), engine.WithLogger(nil)))
				var opts []consumer.Option
				if b.atomic {
					opts = append(opts, consumer.WithAtomic())
				}
				core := grpctest.Must(consumer.New(eng, "charges", opts...))
				r := tbtest.New(t)
				kit := idemtest.New(r, idemtest.Chaos{Effects: b.effects})
				results := kit.Process(t.Context(), core, deliveries(), func(ctx context.Context, d consumer.Delivery) error {
					_, err := b.charge(ctx, string(d.Body), m, nil)
					if status.Convert(err).Message() == "card declined" {
						return consumer.Final(err)
					}
					return err
				})
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
