package engine

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// writeCounter is a memory store that counts its writes.
type writeCounter struct {
	*memory.Store
	writes atomic.Int64
}

func (s *writeCounter) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.writes.Add(1)
	return s.Store.Reserve(ctx, r)
}

func (s *writeCounter) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	s.writes.Add(1)
	return s.Store.Complete(ctx, key, token, outcome)
}

func (s *writeCounter) StartStep(ctx context.Context, r store.StepStart) (store.StepEntry, error) {
	s.writes.Add(1)
	return s.Store.StartStep(ctx, r)
}

func (s *writeCounter) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	s.writes.Add(1)
	return s.Store.FinishStep(ctx, key, token, name, result)
}

func (s *writeCounter) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	s.writes.Add(1)
	return s.Store.Renew(ctx, key, token, lease)
}

// BenchmarkStep serves first calls on the memory store, interleaved: one
// whose handler does nothing, and one whose handler runs one step. It
// reports each one's time and store writes, and what the step adds: one
// write before it (StartStep) and one after (FinishStep).
func BenchmarkStep(b *testing.B) {
	// Room for every call of a second's loop, however fast: the bounds'
	// refusal (StoreFull) is not what this measures.
	st := &writeCounter{Store: memory.New(memory.WithMaxRecords(1<<30), memory.WithMaxBytes(1<<40))}
	e := mustEngine(b, st, WithLogger(nil))
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		b.Fatal(err)
	}
	plain := func(context.Context) error { return nil }
	stepped := func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(context.Context) (string, error) { return "ch_1", nil }, nil)
		return err
	}
	var spent [2]time.Duration
	var writes [2]int64
	n := 0
	for b.Loop() {
		for j := range 2 {
			i := (n + j) % 2
			h := plain
			if i == 1 {
				h = stepped
			}
			before := st.writes.Load()
			began := time.Now()
			if a := serve(e, op, strconv.Itoa(n)+"-"+strconv.Itoa(i), h); a.Verdict != Executed {
				b.Fatalf("verdict %v, want executed", a.Verdict)
			}
			spent[i] += time.Since(began)
			writes[i] += st.writes.Load() - before
		}
		n++
	}
	b.ReportMetric(float64(spent[0].Nanoseconds())/float64(n), "plain-ns/call")
	b.ReportMetric(float64(spent[1].Nanoseconds())/float64(n), "step-ns/call")
	b.ReportMetric(float64(writes[0])/float64(n), "plain-writes/call")
	b.ReportMetric(float64(writes[1]-writes[0])/float64(n), "step-added-writes")
	b.ReportMetric(float64(spent[1])/float64(spent[0]), "step/plain")
}
