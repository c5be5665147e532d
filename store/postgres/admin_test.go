package postgres_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// Records reads one key by the range from it to it with a zero byte
// appended, a prefix's records in key order up to the limit, and fails on a
// missing table even with a limit of 0.
func TestRecords(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	done, running := store.ScopeKey("t", "/m", "done"), store.ScopeKey("t", "/m", "running")
	if err := r.store.Complete(ctx, done, acquire(t, r.store, done), []byte("reply")); err != nil {
		t.Fatal(err)
	}
	acquire(t, r.store, running)

	recs, err := r.store.Records(ctx, done[:], append(done[:len(done):len(done)], 0), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || recs[0].Key != done || recs[0].State != "completed" || string(recs[0].Outcome) != "reply" ||
		!bytes.Equal(recs[0].Fingerprint, fpA[:]) || recs[0].Now.IsZero() || !recs[0].Expires.After(recs[0].Now) {
		t.Fatalf("Records(done) = %+v, want its completed record", recs)
	}

	all, err := r.store.Records(ctx, nil, nil, 10)
	if err != nil || len(all) != 2 || bytes.Compare(all[0].Key[:], all[1].Key[:]) >= 0 {
		t.Fatalf("Records(all) = %d records, %v; want both in key order", len(all), err)
	}
	if one, err := r.store.Records(ctx, nil, nil, 1); err != nil || len(one) != 1 || one[0].Key != all[0].Key {
		t.Fatalf("Records(limit 1) = %+v, %v; want the first key only", one, err)
	}
	if none, err := r.store.Records(ctx, all[1].Key[:], nil, 10); err != nil || len(none) != 1 || none[0].Key != all[1].Key {
		t.Fatalf("Records(from the second key) = %d records, %v; want the second only", len(none), err)
	}

	missing := newStore(t, r.pool, postgres.WithTable("no_such_table"), postgres.WithoutSchemaCheck())
	if _, err := missing.Records(ctx, nil, nil, 0); err == nil {
		t.Fatal("Records on a missing table succeeded")
	}
}

// Forget deletes a completed record and one whose lease ended, refuses one
// under a live lease unless forced, and tells an absent key.
func TestForget(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	done, live, ended := store.ScopeKey("t", "/m", "done"), store.ScopeKey("t", "/m", "live"), store.ScopeKey("t", "/m", "ended")
	doneToken := acquire(t, r.store, done)
	if _, err := r.store.StartStep(ctx, store.StepStart{Key: done, Name: "charge", Token: doneToken, Retention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := r.store.Complete(ctx, done, doneToken, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	acquire(t, r.store, ended)
	r.advance(t, 2*lease) // ended's lease is over, and done stays within its retention
	acquire(t, r.store, live)

	rec, deleted, err := r.store.Forget(ctx, done, false)
	if err != nil || !deleted || rec.Key != done || rec.State != "completed" {
		t.Fatalf("Forget(completed) = %+v, %v, %v; want it deleted", rec, deleted, err)
	}
	if steps, err := r.store.Steps(ctx, done); err != nil || len(steps) != 0 {
		t.Fatalf("the forgotten key's steps = %+v, %v; want them deleted with it", steps, err)
	}
	if rec, deleted, err = r.store.Forget(ctx, ended, false); err != nil || !deleted || rec.State != "in_progress" {
		t.Fatalf("Forget(lease ended) = %+v, %v, %v; want it deleted", rec, deleted, err)
	}
	rec, deleted, err = r.store.Forget(ctx, live, false)
	if err != nil || deleted || rec.Key != live || !rec.LeaseEnd.After(rec.Now) {
		t.Fatalf("Forget(live lease) = %+v, %v, %v; want it refused, with the record", rec, deleted, err)
	}
	if n := r.count(t, "true"); n != 1 {
		t.Fatalf("%d records left, want the live one", n)
	}
	if rec, deleted, err = r.store.Forget(ctx, live, true); err != nil || !deleted || rec.Key != live {
		t.Fatalf("Forget(live lease, force) = %+v, %v, %v; want it deleted", rec, deleted, err)
	}
	if rec, deleted, err = r.store.Forget(ctx, live, false); err != nil || deleted || rec.State != "" {
		t.Fatalf("Forget(absent) = %+v, %v, %v; want a zero record", rec, deleted, err)
	}
}

// Stats counts the records by state with the store's Sweep condition for
// expired ones, the oldest live run, and the table's and indexes' sizes.
func TestStats(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	key := func(name string) store.Key { return store.ScopeKey("t", "/m", name) }
	old := key("old")
	if err := r.store.Complete(ctx, old, acquire(t, r.store, old), []byte("reply")); err != nil {
		t.Fatal(err)
	}
	acquire(t, r.store, key("ended"))
	r.advance(t, retention+time.Minute) // old has expired; ended's lease is over
	acquire(t, r.store, key("live"))
	if err := r.store.Complete(ctx, key("new"), acquire(t, r.store, key("new")), []byte("reply")); err != nil {
		t.Fatal(err)
	}

	st, err := r.store.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Completed != 2 || st.InProgress != 2 || st.InProgressLive != 1 || st.Expired != 2 {
		t.Errorf("Stats = completed %d, in progress %d (%d live), expired %d; want 2, 2 (1), 2",
			st.Completed, st.InProgress, st.InProgressLive, st.Expired)
	}
	if age := st.Now.Sub(st.OldestLive); st.OldestLive.IsZero() || age < 0 || age > time.Minute {
		t.Errorf("OldestLive is %v before the database's now: want the live record's creation", age)
	}
	if st.TableBytes <= 0 || st.TotalBytes < st.TableBytes || len(st.Indexes) < 2 {
		t.Errorf("sizes: table %d, total %d, indexes %v; want the table, and its key and expiry indexes", st.TableBytes, st.TotalBytes, st.Indexes)
	}
	for name, size := range st.Indexes {
		if size <= 0 {
			t.Errorf("index %s: %d bytes", name, size)
		}
	}

	empty := newReplica(t)
	if st, err := empty.store.Stats(ctx); err != nil || st.Completed+st.InProgress != 0 || !st.OldestLive.IsZero() {
		t.Errorf("Stats of an empty table = %+v, %v", st, err)
	}
}

// Steps lists a key's unexpired steps by name; ResolveStep records the
// result of a started step, or deletes it so that the next run starts it
// anew, and refuses a finished step and a key under a live lease.
func TestStepsAndResolveStep(t *testing.T) {
	r := newReplica(t)
	ctx := context.Background()
	key := store.ScopeKey("t", "/m", "steps")
	token := acquire(t, r.store, key)
	for _, name := range []string{"refund", "charge", "email"} {
		if _, err := r.store.StartStep(ctx, store.StepStart{Key: key, Name: name, Token: token, Fingerprint: fpA}); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.store.FinishStep(ctx, key, token, "charge", []byte(`"ch_1"`)); err != nil {
		t.Fatal(err)
	}
	steps, err := r.store.Steps(ctx, key)
	if err != nil || len(steps) != 3 {
		t.Fatalf("Steps = %+v, %v; want 3", steps, err)
	}
	if s := steps[0]; s.Name != "charge" || !s.Done || string(s.Result) != `"ch_1"` || s.Fingerprint != fpA || !s.Expires.After(s.Now) || s.Started.After(s.Now) {
		t.Errorf("Steps[0] = %+v, want charge, done", s)
	}
	if s := steps[1]; s.Name != "email" || s.Done || s.Result != nil {
		t.Errorf("Steps[1] = %+v, want email, started", s)
	}

	if found, err := r.store.ResolveStep(ctx, key, "email", true, []byte("1")); !found || err == nil || !strings.Contains(err.Error(), "live lease") {
		t.Errorf("ResolveStep under a live lease = %v, %v; want found, refused", found, err)
	}
	if err := r.store.Release(ctx, key, token); err != nil {
		t.Fatal(err)
	}
	if found, err := r.store.ResolveStep(ctx, key, "email", true, []byte("1")); !found || err != nil {
		t.Errorf("ResolveStep(email, done) = %v, %v; want found", found, err)
	}
	if found, err := r.store.ResolveStep(ctx, key, "refund", false, nil); !found || err != nil {
		t.Errorf("ResolveStep(refund, not done) = %v, %v; want found", found, err)
	}
	if found, err := r.store.ResolveStep(ctx, key, "charge", false, nil); !found || err == nil || !strings.Contains(err.Error(), `step "charge" is finished already`) {
		t.Errorf("ResolveStep of a finished step = %v, %v; want found, refused", found, err)
	}
	if found, err := r.store.ResolveStep(ctx, key, "absent", true, []byte("1")); found || err != nil {
		t.Errorf("ResolveStep of no step = %v, %v; want not found", found, err)
	}

	token = acquire(t, r.store, key)
	for name, want := range map[string]store.StepEntry{
		"charge": {State: store.StepDone, Fingerprint: fpA, Result: []byte(`"ch_1"`)},
		"email":  {State: store.StepDone, Fingerprint: fpA, Result: []byte("1")},
		"refund": {State: store.StepNew},
	} {
		res, err := r.store.StartStep(ctx, store.StepStart{Key: key, Name: name, Token: token, Fingerprint: fpA})
		if err != nil || res.State != want.State || !bytes.Equal(res.Result, want.Result) || res.Fingerprint != want.Fingerprint {
			t.Errorf("StartStep(%s) after ResolveStep = %+v, %v; want %+v", name, res, err, want)
		}
	}
}
