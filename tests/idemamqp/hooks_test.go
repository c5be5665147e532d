package idemamqp_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/hooklog"
)

// A message published three times runs one execution and two replays, each
// before its acknowledgement; its id reused with another body runs a
// refusal. A panicking hook changes no outcome, and the fixture checks that
// the logs hold neither the id nor the tenant its panic quotes.
func TestHooks(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, nil)
			st, copts := b.new(t)
			var hooks hooklog.Log
			var runs atomic.Int32
			c := f.consumerWith(st, []engine.Option{engine.WithHooks(hooks.Hooks())}, copts, func(context.Context, amqp.Delivery) error {
				runs.Add(1)
				return nil
			}, consumer.WithMessageTenant(func(d amqp.Delivery) (string, error) { return d.AppId, nil }))
			tenant := f.secret("tenant")
			_, ds := f.consume("", 1)
			for _, panics := range []bool{false, true} {
				hooks.Panics.Store(panics)
				id, body := f.secret("id"), f.secret("body")
				for range 3 {
					f.publish("", amqp.Publishing{MessageId: id, AppId: tenant, Body: []byte(body)})
				}
				f.publish("", amqp.Publishing{MessageId: id, AppId: tenant, Body: []byte(body + " again")})
				handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Rejected, consumer.Reject)
				hooks.Want(t,
					"execute executed ack "+tenant+"/"+id+" 9",
					"replay replayed ack "+tenant+"/"+id+" 9",
					"replay replayed ack "+tenant+"/"+id+" 9",
					"refuse reused reject "+tenant+"/"+id+" 0")
			}
			if n := runs.Load(); n != 2 {
				t.Errorf("the handler ran %d times, want once per message", n)
			}
			if !strings.Contains(f.logs.String(), "hook panicked") {
				t.Errorf("the hook's panics are not logged:\n%s", f.logs)
			}
		})
	}
}
