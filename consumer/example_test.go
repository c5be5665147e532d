package consumer_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/store/memory"
)

// A consumer runs a message's handler once per id: a redelivery is dropped,
// a transient failure is redelivered, and a final one is recorded. A broker
// adapter (idemnats, idemamqp, idemkafka) reads each delivery and acts on
// the Result; here the deliveries are written by hand.
func Example() {
	eng, err := engine.New(memory.New(), engine.WithRetention(consumer.RecommendedRetention))
	if err != nil {
		panic(err)
	}
	core, err := consumer.New(eng, "billing")
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	charged := 0
	charge := func(context.Context) error { charged++; return nil }

	first := consumer.Delivery{ID: "order-1001", Body: []byte("charge 2500 EUR"), Attempt: 1}
	fmt.Println(core.Process(ctx, first, charge))
	again := first
	again.Attempt, again.Redelivered = 2, true
	fmt.Println(core.Process(ctx, again, charge))

	down := consumer.Delivery{ID: "order-1002", Body: []byte("charge 900 EUR"), Attempt: 1}
	res := core.Process(ctx, down, func(context.Context) error { return errors.New("the ledger is down") })
	fmt.Println(res.Outcome, res.Action)
	declined := consumer.Delivery{ID: "order-1003", Body: []byte("charge 100 EUR"), Attempt: 1}
	res = core.Process(ctx, declined, func(context.Context) error { return consumer.Final(errors.New("card declined")) })
	fmt.Println(res, "dead letter:", res.DeadLetter, "cause:", consumer.Cause(res.Err))
	fmt.Println("charged", charged)
	// Output:
	// processed (ack)
	// duplicate (ack)
	// retry nak
	// failed (ack) dead letter: true cause: a final error (consumer.Final) of type *errors.errorString (its words are left out: they may quote the message)
	// charged 1
}
