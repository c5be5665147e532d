package spanner_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/enginetest"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// A reply larger than a Spanner cell holds (10 MiB), under an engine whose
// WithMaxRecordSize allows it, is answered by the stand-in, recorded, as a
// store too full for it is: never by a success that no record backs, which
// a retry after the lease would run again.
func TestOutcomeOverCell(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		st, client := newStore(t)
		e, err := engine.New(st, engine.WithSingleTenant(), engine.WithMaxRecordSize(16<<20),
			engine.WithLease(time.Second), engine.WithInProgressWait(0), engine.WithLogger(nil))
		if err != nil {
			t.Fatal(err)
		}
		op, err := e.Operation(engine.OperationSpec{Name: "/test.v1.Big/Get", Atomic: atomic})
		if err != nil {
			t.Fatal(err)
		}
		big := bytes.Repeat([]byte{1}, 11<<20)
		first := enginetest.Serve(t.Context(), e, op, "k", big)
		if first.Answered.Verdict != engine.Executed || first.Answered.StandIn == nil {
			t.Errorf("atomic %v: an 11 MiB reply: %v, stand-in %v; want executed and answered by the stand-in",
				atomic, first.Answered.Verdict, first.Answered.StandIn)
		}
		// Past the first call's lease, as if it had passed on Spanner's clock.
		shift(t, client, idemspanner.DefaultTable, time.Minute)
		retry := enginetest.Serve(t.Context(), e, op, "k", big)
		if retry.Ran || retry.Answered.Verdict != engine.Replayed || string(retry.Answered.Outcome) != "stand-in" {
			t.Errorf("atomic %v: its retry: %v %q (ran %v); want the stand-in replayed, the handler not run again",
				atomic, retry.Answered.Verdict, retry.Answered.Outcome[:min(len(retry.Answered.Outcome), 16)], retry.Ran)
		}
	}
}
