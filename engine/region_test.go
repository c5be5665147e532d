package engine

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
)

// regionCall is a call that says which region it was first sent to.
type regionCall struct {
	stepCall
	firstRegion []string
}

func (x *regionCall) FirstRegion() []string { return x.firstRegion }

// serveFrom serves one call of key, first sent to the regions given (none:
// not said), and returns it.
func serveFrom(e *Engine, op *Operation, key string, regions ...string) *regionCall {
	x := &regionCall{stepCall: stepCall{key: key, request: "r", run: func(context.Context) error { return nil }}, firstRegion: regions}
	e.Serve(context.Background(), op, x)
	return x
}

// withoutFind is a store that cannot Find: the fence reserves and releases.
type withoutFind struct{ store.Store }

// TestFence checks an engine of region a: a key first sent to region b runs
// nothing here, and its record, once region b has made it in the store, is
// replayed; on a store that can Find and on one that cannot, in either mode.
func TestFence(t *testing.T) {
	for _, tc := range []struct {
		name   string
		find   bool
		atomic bool
	}{{"find", true, false}, {"find/atomic", true, true}, {"reserve", false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			fake := newFakeStore()
			var st store.Store = fake
			if !tc.find {
				st = withoutFind{fake}
			}
			spec := OperationSpec{Name: opName, Atomic: tc.atomic}
			a, _ := stepEngine(t, st, WithRegion("a"))
			b, _ := stepEngine(t, st, WithRegion("b"))
			opA, err := a.Operation(spec)
			if err != nil {
				t.Fatal(err)
			}
			opB, err := b.Operation(spec)
			if err != nil {
				t.Fatal(err)
			}
			fenced := serveFrom(a, opA, "k1", "b")
			if fenced.ran || fenced.answer.Verdict != InProgress || fenced.answer.RetryAfter != DefaultMaxRetryAfter {
				t.Fatalf("first sent to b, served by a: ran %v, answered %+v; want in progress, with the retry delay, not run", fenced.ran, fenced.answer)
			}
			if fake.has(store.ScopeKey("", opName, "k1")) {
				t.Fatal("the fenced call left a record of its key")
			}
			first := serveFrom(b, opB, "k1", "b")
			if !first.ran || first.answer.Verdict != Executed {
				t.Fatalf("served by b, its first region: ran %v, answered %+v; want executed", first.ran, first.answer)
			}
			again := serveFrom(a, opA, "k1", "b")
			if again.ran || again.answer.Verdict != Replayed || string(again.answer.Outcome) != "done" {
				t.Fatalf("served by a once b's record is there: ran %v, answered %+v; want replayed", again.ran, again.answer)
			}
			// This region's keys, and keys that say no region, run here.
			for _, regions := range [][]string{{"a"}, {" a\t"}, nil} {
				if x := serveFrom(a, opA, "k-"+strings.Join(regions, ""), regions...); !x.ran || x.answer.Verdict != Executed {
					t.Errorf("first sent to %q, served by a: ran %v, answered %+v; want executed", regions, x.ran, x.answer)
				}
			}
		})
	}
}

// TestFenceRefusals checks what a fenced engine refuses: a malformed or
// repeated first region, and a store that fails, which never runs a key
// first sent elsewhere, even failing open. An engine without a region
// reads no first region.
func TestFenceRefusals(t *testing.T) {
	st := newFakeStore()
	e, op := stepEngine(t, st, WithRegion("eu-west-1"), WithFailOpen())
	for _, regions := range [][]string{{"EU-West"}, {""}, {"eu_west"}, {strings.Repeat("x", 64)}, {"eu", "eu"}} {
		x := serveFrom(e, op, "k1", regions...)
		var fse *FirstSentError
		if x.ran || x.answer.Verdict != FirstSentInvalid || !errors.As(x.answer.Err, &fse) || len(regions[0]) > 2 && strings.Contains(fse.Problem, regions[0]) {
			t.Errorf("first region %q: ran %v, answered %+v; want first_sent_invalid, not quoting it", regions, x.ran, x.answer)
		}
	}
	st.fail(mFind, errors.New("down"), forever)
	st.fail(mReserve, errors.New("down"), forever)
	if x := serveFrom(e, op, "k2", "us-east-1"); x.ran || x.answer.Verdict != StoreUnavailable {
		t.Errorf("a failing store, first sent elsewhere: ran %v, answered %+v; want store_unavailable, never failing open", x.ran, x.answer)
	}
	if x := serveFrom(e, op, "k2", "eu-west-1"); !x.ran {
		t.Errorf("a failing store, first sent here: answered %+v; want it to fail open", x.answer)
	}
	st.fail(mFind, nil, 0)
	st.fail(mReserve, nil, 0)
	plain, plainOp := stepEngine(t, newFakeStore())
	for _, regions := range [][]string{{"b"}, {"EU", "EU"}} {
		if x := serveFrom(plain, plainOp, "k3-"+regions[0], regions...); !x.ran || x.answer.Verdict != Executed {
			t.Errorf("no region, first region %q: ran %v, answered %+v; want executed", regions, x.ran, x.answer)
		}
	}
}

// TestFenceStale checks that a key first sent elsewhere longer ago than the
// retention, with no record here, is expired rather than fenced forever.
func TestFenceStale(t *testing.T) {
	e, op := stepEngine(t, newFakeStore(), WithRegion("a"), WithRetention(time.Hour))
	x := &regionCall{stepCall: stepCall{key: "k1", request: "r", run: func(context.Context) error { return nil }}, firstRegion: []string{"b"}}
	e.Serve(context.Background(), op, &firstSentCall{x, time.Now().Add(-2 * time.Hour)})
	if x.ran || x.answer.Verdict != Expired {
		t.Errorf("ran %v, answered %+v; want key_expired", x.ran, x.answer)
	}
}

type firstSentCall struct {
	*regionCall
	at time.Time
}

func (x *firstSentCall) FirstSent() []string {
	return []string{x.at.UTC().Format("Mon, 02 Jan 2006 15:04:05 GMT")}
}

// batchFake is the fake store as a store.BatchReserver.
type batchFake struct{ *fakeStore }

func (s batchFake) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	res := make([]store.Entry, len(rs))
	for i, r := range rs {
		var err error
		if res[i], err = s.Reserve(ctx, r); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// TestFenceBatch checks that a batch serves a call first sent elsewhere
// alone, fenced, and the others as usual.
func TestFenceBatch(t *testing.T) {
	e, op := stepEngine(t, batchFake{newFakeStore()}, WithRegion("a"))
	if !e.canBatch(op) {
		t.Fatal("the fake does not batch")
	}
	run := func(context.Context) error { return nil }
	xs := []*regionCall{
		{stepCall: stepCall{key: "k1", request: "r", run: run}, firstRegion: []string{"b"}},
		{stepCall: stepCall{key: "k2", request: "r", run: run}},
		{stepCall: stepCall{key: "k3", request: "r", run: run}, firstRegion: []string{"a"}},
	}
	e.ServeBatch(context.Background(), op, []Exchange{xs[0], xs[1], xs[2]})
	if x := xs[0]; x.ran || x.answer.Verdict != InProgress {
		t.Errorf("first sent to b: ran %v, answered %+v; want in progress, not run", x.ran, x.answer)
	}
	for _, x := range xs[1:] {
		if !x.ran || x.answer.Verdict != Executed {
			t.Errorf("%s: ran %v, answered %+v; want executed", x.key, x.ran, x.answer)
		}
	}
}
