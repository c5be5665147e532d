package idemamqp_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemamqp"
)

// hookLog is an application's hooks: it keeps each event as "hook verdict
// action tenant/key size", and then panics if told to.
type hookLog struct {
	mu     sync.Mutex
	events []string
	panics atomic.Bool
}

func (h *hookLog) hooks() consumer.Hooks {
	keep := func(hook string) func(context.Context, engine.Event) {
		return func(_ context.Context, ev engine.Event) {
			h.mu.Lock()
			h.events = append(h.events, fmt.Sprintf("%s %s %s %s/%s %d", hook, ev.Verdict, consumer.Action(ev.Code), ev.Tenant, ev.Key, ev.Size))
			h.mu.Unlock()
			if h.panics.Load() {
				panic("audit failed for " + ev.Tenant + "/" + ev.Key)
			}
		}
	}
	return consumer.Hooks{OnExecute: keep("execute"), OnReplay: keep("replay"), OnRefuse: keep("refuse")}
}

func (h *hookLog) want(t *testing.T, want ...string) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if strings.Join(h.events, "\n") != strings.Join(want, "\n") {
		t.Errorf("hooks ran:\n\t%s\nwant:\n\t%s", strings.Join(h.events, "\n\t"), strings.Join(want, "\n\t"))
	}
	h.events = nil
}

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
			var hooks hookLog
			var runs atomic.Int32
			c := f.consumer(st, append(copts, consumer.WithHooks(hooks.hooks())), func(context.Context, amqp.Delivery) error {
				runs.Add(1)
				return nil
			}, idemamqp.WithMessageTenant(func(d amqp.Delivery) (string, error) { return d.AppId, nil }))
			tenant := f.secret("tenant")
			_, ds := f.consume("", 1)
			for _, panics := range []bool{false, true} {
				hooks.panics.Store(panics)
				id, body := f.secret("id"), f.secret("body")
				for range 3 {
					f.publish("", amqp.Publishing{MessageId: id, AppId: tenant, Body: []byte(body)})
				}
				f.publish("", amqp.Publishing{MessageId: id, AppId: tenant, Body: []byte(body + " again")})
				handle(t, c, next(t, ds), consumer.Processed, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Duplicate, consumer.Ack)
				handle(t, c, next(t, ds), consumer.Refused, consumer.Reject)
				hooks.want(t,
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
