package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/memory"
)

// order is a message of a broker made up for the example.
type order struct {
	ID, Body string
	Attempt  int
}

// orders is the made-up broker's consumer.Broker, as idemnats, idemamqp and
// idemkafka each write one: it reads an order, and settles by printing what
// it would tell the broker.
type orders struct{}

func (orders) System() string { return "example" }

func (orders) ID(o order) (string, error) { return o.ID, nil }

func (orders) Read(o order) (consumer.Delivery, error) {
	return consumer.Delivery{Body: []byte(o.Body), Attempt: o.Attempt, Redelivered: o.Attempt > 1}, nil
}

func (orders) Settle(_ context.Context, os []order, results []consumer.Result) error {
	for i, o := range os {
		fmt.Println(o.ID, results[i].Outcome, results[i].Action)
	}
	return nil
}

func (orders) Horizons(time.Duration) []consumer.Horizon {
	return []consumer.Horizon{{Bound: 72 * time.Hour, Source: "orders are kept three days"}}
}

// A consumer runs a message's handler once per id: a redelivery is dropped,
// a transient failure is delivered again, and a final one is recorded and
// dead-lettered.
func Example() {
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		panic(err)
	}
	charged := 0
	c, err := consumer.New(eng, "billing", orders{}, func(ctx context.Context, o order) error {
		switch o.Body {
		case "charge 900 EUR":
			return errors.New("the ledger is down")
		case "charge 100 EUR":
			return consumer.Final(errors.New("card declined"))
		}
		charged++
		return nil
	}, consumer.WithDeadLetter(func(_ context.Context, o order, err error) error {
		fmt.Println("dead letter", o.ID+":", consumer.Cause(err))
		return nil
	}))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	c.Handle(ctx, order{"order-1001", "charge 2500 EUR", 1})
	c.Handle(ctx, order{"order-1001", "charge 2500 EUR", 2})
	c.Handle(ctx, order{"order-1002", "charge 900 EUR", 1})
	c.Handle(ctx, order{"order-1003", "charge 100 EUR", 1})
	fmt.Println("charged", charged)
	// Output:
	// order-1001 processed ack
	// order-1001 duplicate ack
	// order-1002 retry nak
	// dead letter order-1003: a final error (consumer.Final) of type *errors.errorString (its words are left out: they may quote the message)
	// order-1003 failed ack
	// charged 1
}
