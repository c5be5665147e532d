package engine

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/store/memory"
)

// NextMessageID numbers a run's messages from 1, derives each id from the
// call's tenant, operation and key, and gives all of the call's the one
// partition; a re-run numbers anew, so makes the same ids; outside a call
// there is none.
func TestNextMessageID(t *testing.T) {
	const tenant = "tenant-messages"
	e, err := New(memory.New(), WithTenant(func(context.Context) (string, error) { return tenant, nil }))
	if err != nil {
		t.Fatal(err)
	}
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	if id, partition, ok := NextMessageID(context.Background()); ok || id != "" || partition != "" {
		t.Errorf("outside a call: %q, %q, %v; want nothing", id, partition, ok)
	}

	var runs [][]string
	handler := func(fail bool) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			var ids []string
			for range 3 {
				id, partition, ok := NextMessageID(ctx)
				if !ok {
					t.Error("no message id in a keyed call")
				}
				if want := idemkey.DeriveKey(tenant, opName, "order-m", "outbox messages"); partition != want {
					t.Errorf("partition %s, want %s", partition, want)
				}
				ids = append(ids, id)
			}
			runs = append(runs, ids)
			if fail {
				return errors.New("released")
			}
			return nil
		}
	}
	serve(e, op, "order-m", handler(true))
	if a := serve(e, op, "order-m", handler(false)); a.Verdict != Executed {
		t.Fatalf("re-run: %v", a.Verdict)
	}
	if len(runs) != 2 {
		t.Fatalf("%d runs, want 2", len(runs))
	}
	for i, id := range runs[0] {
		if want := idemkey.DeriveKey(tenant, opName, "order-m", "outbox message "+strconv.Itoa(i+1)); id != want {
			t.Errorf("message %d: %s, want %s", i+1, id, want)
		}
	}
	if !slices.Equal(runs[0], runs[1]) {
		t.Errorf("the re-run made %v, the first run %v", runs[1], runs[0])
	}

	// Another key makes other ids.
	var other string
	serve(e, op, "order-n", func(ctx context.Context) error { other, _, _ = NextMessageID(ctx); return nil })
	if other != idemkey.DeriveKey(tenant, opName, "order-n", "outbox message 1") {
		t.Errorf("another key's first message: %s", other)
	}

	// Messages published at once from several goroutines of one handler
	// each get a place of their own.
	const n = 16
	got := map[string]bool{}
	serve(e, op, "order-c", func(ctx context.Context) error {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				id, _, _ := NextMessageID(ctx)
				mu.Lock()
				got[id] = true
				mu.Unlock()
			})
		}
		wg.Wait()
		return nil
	})
	for i := range n {
		if !got[idemkey.DeriveKey(tenant, opName, "order-c", "outbox message "+strconv.Itoa(i+1))] {
			t.Errorf("no goroutine got message %d's id (%d ids)", i+1, len(got))
		}
	}
}
