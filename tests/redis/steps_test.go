package redis_test

import (
	"context"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// A key's steps are one hash beside its record, in its hash slot, that
// outlives Release and expires natively with the record.
func TestStepsBesideRecord(t *testing.T) {
	client := redistest.Client(t)
	p := prefix()
	st, err := redis.New(context.Background(), client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r := store.Reservation{Key: store.ScopeKey("acme", "/m", "key"), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour}
	res, err := st.Reserve(ctx, r)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve = %v, %v", res.State, err)
	}
	if _, err := st.StartStep(ctx, store.StepStart{Key: r.Key, Name: "charge", Token: res.Token, Fingerprint: r.Fingerprint}); err != nil {
		t.Fatal(err)
	}
	must(t, st.Release(ctx, r.Key, res.Token))

	name := p + ":{" + hex.EncodeToString(r.Key[:]) + "}:steps"
	ttl, err := client.PTTL(ctx, name).Result()
	if err != nil || ttl < r.Retention-time.Minute || ttl > r.Retention+time.Second {
		t.Errorf("PTTL of %s after Release = %v, %v; want about the record's retention, %v", name, ttl, err, r.Retention)
	}
}

// A step lost with the server's state is never reported absent: after a
// restore from a snapshot that holds the run's record but not its step,
// StartStep fails closed rather than let the step run again; and after
// FLUSHDB every step method and Renew fail so.
func TestStepsLostFailClosed(t *testing.T) {
	srv := redistest.Start(t) // save "": nothing is written to disk but by SAVE
	client := srv.Client(t)
	ctx := context.Background()
	stores := make([]*redis.Store, 5)
	for i := range stores {
		var err error
		if stores[i], err = redis.New(ctx, client); err != nil {
			t.Fatal(err)
		}
	}
	r := store.Reservation{Key: store.ScopeKey("acme", "/m", "key"), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour}
	res, err := stores[0].Reserve(ctx, r)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve = %v, %v", res.State, err)
	}
	start := store.StepStart{Key: r.Key, Name: "charge", Token: res.Token, Fingerprint: r.Fingerprint}
	must(t, client.Save(ctx).Err())
	if step, err := stores[0].StartStep(ctx, start); err != nil || step.State != store.StepNew {
		t.Fatalf("StartStep = %v, %v; want StepNew", step.State, err)
	}

	srv.Kill()
	srv.Restart(t)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		var step store.StepEntry
		step, err = stores[0].StartStep(ctx, start)
		if err == nil {
			t.Fatalf("StartStep of a step lost in the restore = %v; want store.ErrDataLost", step.State)
		}
		if !errors.Is(err, store.ErrUnavailable) || time.Now().After(deadline) {
			break // else the client reconnects
		}
	}
	wantDataLost(t, "StartStep of a step lost in the restore", err, "data was lost", "write counter")

	// The record is back in progress, under the same token: the other
	// stores, which saw no counter past the snapshot, take it as it is
	// until the flush.
	must(t, stores[1].Renew(ctx, r.Key, res.Token, time.Minute))
	must(t, client.FlushDB(ctx).Err())
	_, err = stores[1].StartStep(ctx, start)
	wantDataLost(t, "StartStep after FLUSHDB", err, "data was lost")
	wantDataLost(t, "FinishStep after FLUSHDB", stores[2].FinishStep(ctx, r.Key, res.Token, "charge", []byte("x")), "data was lost")
	wantDataLost(t, "ForgetSteps after FLUSHDB", stores[3].ForgetSteps(ctx, r.Key, res.Token), "data was lost")
	wantDataLost(t, "Renew after FLUSHDB", stores[4].Renew(ctx, r.Key, res.Token, time.Minute), "data was lost")
}
