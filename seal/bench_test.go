package seal_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/idemkey/idemkey/internal/enginetest"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store/memory"
)

// BenchmarkSealedEngineCall measures what sealing costs the engine's request
// path for a 1 KiB reply, on the memory store, without a transport's noise:
// a first call (Start and Record: one Seal) and a replay (Start: one Open),
// each on an engine without and one with a key ring, interleaved. It reports
// each one's time and the sealed call's ratio to the plain one.
func BenchmarkSealedEngineCall(b *testing.B) {
	ring, err := seal.NewKeyRing(newKey(b))
	if err != nil {
		b.Fatal(err)
	}
	reply := make([]byte, 1024)
	rand.Read(reply)
	type side struct {
		e  *engine.Engine
		op *engine.Operation
	}
	newSide := func(opts ...engine.Option) side {
		e, err := engine.New(memory.New(memory.WithMaxRecords(1<<24), memory.WithMaxBytes(1<<40)),
			append(opts, engine.WithTenant(func(context.Context) (string, error) { return "acme", nil }), engine.WithLogger(nil), engine.WithMaxRecordSize(4096))...)
		if err != nil {
			b.Fatal(err)
		}
		op, err := e.Operation(engine.OperationSpec{Name: "/bench.v1.Payments/Charge"})
		if err != nil {
			b.Fatal(err)
		}
		return side{e, op}
	}
	plain, sealed := newSide(), newSide(engine.WithSealer(ring))
	ctx := context.Background()
	call := func(s side, key string) error {
		c := enginetest.Serve(ctx, s.e, s.op, key, bytes.Clone(reply)) // an adapter encodes each reply anew
		switch a := c.Answered; {
		case a.Verdict == engine.Executed && a.StandIn == nil:
			return nil
		case a.Verdict == engine.Replayed:
			if len(a.Outcome) != len(reply) {
				return fmt.Errorf("replayed %d bytes", len(a.Outcome))
			}
			return nil
		default:
			return fmt.Errorf("verdict %v", a.Verdict)
		}
	}
	for _, s := range []side{plain, sealed} {
		if err := call(s, "replay"); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("call=first", func(b *testing.B) {
		run := strconv.FormatInt(time.Now().UnixNano(), 36) // new keys on every run of the benchmark
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "plain", Run: func(i int) error { return call(plain, run+strconv.Itoa(i)) }},
			benchtest.Op{Name: "sealed", Run: func(i int) error { return call(sealed, run+strconv.Itoa(i)) }},
		)
		b.ReportMetric(means[1]/means[0], "sealed/plain")
	})
	b.Run("call=replay", func(b *testing.B) {
		means := benchtest.Interleave(b,
			benchtest.Op{Name: "plain", Run: func(int) error { return call(plain, "replay") }},
			benchtest.Op{Name: "sealed", Run: func(int) error { return call(sealed, "replay") }},
		)
		b.ReportMetric(means[1]/means[0], "sealed/plain")
	})
}
