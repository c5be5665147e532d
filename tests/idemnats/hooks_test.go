package idemnats_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkey/idemkey/consumer"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/hooklog"
	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
	"github.com/idemkey/idemkey/tests/natstest"
)

// TestHooks: a message published three times runs one execution and two
// replays, each before its acknowledgement; its id reused with another body
// runs a refusal; and a panicking hook changes no outcome and logs neither
// id nor tenant. The ids are in the header "order-id" (WithMessageID), so
// that JetStream's duplicate window drops none of the resends. On memory,
// and on PostgreSQL in both modes.
func TestHooks(t *testing.T) {
	orderID := consumer.WithMessageID(func(msg jetstream.Msg) (string, error) {
		if v := msg.Headers().Values("order-id"); len(v) == 1 {
			return v[0], nil
		}
		return "", fmt.Errorf("%w: no order-id header", consumer.ErrNoID)
	})
	for _, tc := range []struct {
		name   string
		store  func(t *testing.T) store.Store
		atomic bool
	}{
		{"memory", func(*testing.T) store.Store { return memory.New() }, false},
		{"postgres", pgStore, false},
		{"postgres-atomic", pgStore, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, js := natstest.Connect(t)
			var hooks hooklog.Log
			logger, logs := logtest.New()
			opts := []consumer.Option{orderID, tenantHeader}
			if tc.atomic {
				opts = append(opts, consumer.WithAtomic())
			}
			r := newRig(t, js, tc.store(t), nil, []engine.Option{engine.WithHooks(hooks.Hooks()), engine.WithLogger(logger)}, opts...)
			for _, panics := range []bool{false, true} {
				hooks.Panics.Store(panics)
				id := fmt.Sprint("order-secret-", panics)
				for range 3 {
					r.publish("", "charge 100", "order-id", id, "tenant", "tenant-secret")
				}
				r.consume(3)
				r.publish("", "charge 200", "order-id", id, "tenant", "tenant-secret")
				r.consume(1)
				hooks.Want(t,
					"execute executed ack tenant-secret/"+id+" 9",
					"replay replayed ack tenant-secret/"+id+" 9",
					"replay replayed ack tenant-secret/"+id+" 9",
					"refuse reused reject tenant-secret/"+id+" 0")
			}
			if got := r.outcomes(); got[consumer.Processed] != 2 || got[consumer.Duplicate] != 4 || got[consumer.Rejected] != 2 {
				t.Errorf("outcomes %v, want 2 processed, 4 duplicates and 2 refused, with a panicking hook or not", got)
			}
			if n := r.runsOf(""); n != 2 {
				t.Errorf("the handler ran %d times, want once per order", n)
			}
			if out := logs.String(); !strings.Contains(out, "hook panicked") || strings.Contains(out, "secret") {
				t.Errorf("want the hook's panics logged, without the message's id or tenant; logged:\n%s", out)
			}
			r.settled()
		})
	}
}

// pgStore is a PostgreSQL store on a schema of t's own.
func pgStore(t *testing.T) store.Store {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st
}
