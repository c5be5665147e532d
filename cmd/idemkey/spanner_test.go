package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"
	instance "cloud.google.com/go/spanner/admin/instance/apiv1"
	"cloud.google.com/go/spanner/admin/instance/apiv1/instancepb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/store"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// spannerDatabase creates an empty database for t on the Spanner emulator
// (SPANNER_EMULATOR_HOST; scripts/with-spanner starts one), dropped when t
// ends, and returns its name. Without an emulator t skips, or fails in CI.
// It is tests/spannertest.Database made small: this module cannot require
// the tests module, which is never tagged, or go install of a release
// would not resolve.
func spannerDatabase(t *testing.T) string {
	t.Helper()
	if os.Getenv("SPANNER_EMULATOR_HOST") == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("SPANNER_EMULATOR_HOST is unset: CI runs the Spanner tests on the emulator (scripts/with-spanner starts one)")
		}
		t.Skip("SPANNER_EMULATOR_HOST is unset: no Spanner emulator (scripts/with-spanner starts one)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const parent = "projects/idemkey-cli/instances/test"
	instances, err := instance.NewInstanceAdminClient(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer instances.Close()
	op, err := instances.CreateInstance(ctx, &instancepb.CreateInstanceRequest{Parent: "projects/idemkey-cli", InstanceId: "test",
		Instance: &instancepb.Instance{Config: "projects/idemkey-cli/instanceConfigs/emulator-config", DisplayName: "idemkey cli", NodeCount: 1}})
	if err == nil {
		_, err = op.Wait(ctx)
	}
	if err != nil && status.Code(err) != codes.AlreadyExists {
		t.Fatalf("create the emulator's instance: %v", err)
	}
	admin, err := database.NewDatabaseAdminClient(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	id := "cli" + hex.EncodeToString([]byte(rand.Text())[:6])
	dbOp, err := admin.CreateDatabase(ctx, &databasepb.CreateDatabaseRequest{Parent: parent, CreateStatement: "CREATE DATABASE `" + id + "`"})
	if err == nil {
		_, err = dbOp.Wait(ctx)
	}
	if err != nil {
		t.Fatalf("create a database on the emulator: %v", err)
	}
	name := parent + "/databases/" + id
	t.Cleanup(func() {
		if err := admin.DropDatabase(context.Background(), &databasepb.DropDatabaseRequest{Database: name}); err != nil {
			t.Errorf("drop the test's database: %v", err)
		}
	})
	return name
}

// newSpannerStore returns a database of its own with the store's tables,
// which migrate up made, and a store on it.
func newSpannerStore(t *testing.T) (db string, st *idemspanner.Store) {
	t.Helper()
	db = spannerDatabase(t)
	mustRun(t, exitOK, db, "migrate", "up")
	return db, spannerStore(t, db)
}

// spannerStore returns a store on db, whose client closes when t ends.
func spannerStore(t *testing.T, db string) *idemspanner.Store {
	t.Helper()
	client, err := spanner.NewClientWithConfig(context.Background(), db, spanner.ClientConfig{DisableNativeMetrics: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	st, err := idemspanner.New(client)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// TestRecordOfGRPCServer on Spanner.
func TestSpannerRecordOfGRPCServer(t *testing.T) {
	db, st := newSpannerStore(t)
	recordOfGRPCServer(t, db, st)
}

// TestForgetLiveInProgress on Spanner.
func TestSpannerForgetLiveInProgress(t *testing.T) {
	db, st := newSpannerStore(t)
	forgetLiveInProgress(t, db, st)
}

// migrate up and status on a fresh database; down refuses tables that hold
// records without -force, and drops them with it.
func TestSpannerMigrate(t *testing.T) {
	db := spannerDatabase(t)
	type migrations struct {
		Changed    []string
		Migrations []struct {
			Name      string
			Applied   bool
			AppliedAt *time.Time `json:"applied_at"`
		}
	}
	migrate := func(want int, args ...string) migrations {
		t.Helper()
		var m migrations
		jsonOf(t, want, db, &m, append([]string{"migrate"}, args...)...)
		return m
	}
	if m := migrate(exitOK, "status"); len(m.Migrations) != 1 || m.Migrations[0].Applied {
		t.Fatalf("status of a fresh database: %+v, want one migration, pending", m)
	}
	_, stderr := mustRun(t, exitDatabase, db, "stats")
	if !strings.Contains(stderr, "table idempotency_keys not found: run idemkey migrate up -spanner "+db) {
		t.Errorf("stats before migrate up says %q, want the command that migrates this Spanner database", stderr)
	}
	if m := migrate(exitOK, "up"); len(m.Changed) != 1 || m.Changed[0] != "001_create_idempotency_keys" || !m.Migrations[0].Applied || m.Migrations[0].AppliedAt != nil {
		t.Fatalf("up: %+v, want 001 applied (with no time: Spanner keeps none)", m)
	}
	if m := migrate(exitOK, "up"); len(m.Changed) != 0 {
		t.Fatalf("a second up applied %v", m.Changed)
	}
	stdout, _ := mustRun(t, exitOK, db, "migrate", "status")
	if !strings.Contains(stdout, "001_create_idempotency_keys  applied\n") {
		t.Errorf("status says:\n%s", stdout)
	}

	reserve(t, spannerStore(t, db), store.ScopeKey("acme", createCharge, "k"), time.Minute)
	_, stderr = mustRun(t, exitRefused, db, "migrate", "down")
	if !strings.Contains(stderr, "holds 1 records") {
		t.Errorf("down of tables with records says %q", stderr)
	}
	mustRun(t, exitOK, db, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "k")
	if m := migrate(exitOK, "down", "-force"); len(m.Changed) != 1 || m.Migrations[0].Applied {
		t.Fatalf("down -force: %+v, want 001 reverted", m)
	}
	mustRun(t, exitDatabase, db, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "k")
	if m := migrate(exitOK, "down"); len(m.Changed) != 0 {
		t.Errorf("down with nothing applied reverted %v", m.Changed)
	}
	migrate(exitOK, "up")
	mustRun(t, exitNotFound, db, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "k")
}

// stats counts the records by state; sweep has nothing to do on Spanner.
func TestSpannerStats(t *testing.T) {
	db, st := newSpannerStore(t)
	ctx := context.Background()
	reserve(t, st, store.ScopeKey("acme", createCharge, "running"), time.Minute)
	reserve(t, st, store.ScopeKey("acme", createCharge, "dead"), time.Microsecond) // its lease ends at once
	retention := map[string]time.Duration{"done": time.Hour, "old": time.Microsecond}
	for key, keep := range retention {
		k := store.ScopeKey("acme", createCharge, key)
		res, err := st.Reserve(ctx, store.Reservation{Key: k, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: keep})
		if err != nil || res.State != store.Acquired {
			t.Fatalf("reserve %s: %v, %v", key, res.State, err)
		}
		if err := st.Complete(ctx, k, res.Token, []byte{}); err != nil {
			t.Fatal(err)
		}
	}

	var s statsJSON
	jsonOf(t, exitOK, db, &s, "stats")
	if s.Completed != 2 || s.InProgress != 2 || s.Live != 1 || s.Expired != 1 || s.Oldest == nil || *s.Oldest < 0 || *s.Oldest > 60 || s.Total != nil {
		t.Errorf("stats: %+v, want 2 completed (1 expired), 2 in progress (1 live), no sizes", s)
	}
	statsShows(t, db, "expired, not yet deleted", "oldest live in progress", "not told to a query on Spanner")
	var old inspected
	jsonOf(t, exitOK, db, &old, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "old")
	if !old.Expired || old.State != "completed" {
		t.Errorf("inspect of an expired record: %+v, want completed and expired", old)
	}
	// inspect lists a key's steps (a Spanner step keeps no start time).
	done := store.ScopeKey("acme", createCharge, "done")
	if _, err := st.StartStep(ctx, store.StepStart{Key: done, Name: "charge", Fingerprint: store.Fingerprint{1}, Retention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	var steps struct{ Steps []stepView }
	jsonOf(t, exitOK, db, &steps, "inspect", "-tenant", "acme", "-method", createCharge, "-key", "done")
	if len(steps.Steps) != 1 || steps.Steps[0].Name != "charge" || steps.Steps[0].State != "started" || !steps.Steps[0].Started.IsZero() {
		t.Errorf("inspect's steps: %+v, want charge started, with no start time", steps.Steps)
	}

	var swept struct {
		Deleted int
		Nothing string `json:"nothing_to_sweep"`
	}
	jsonOf(t, exitOK, db, &swept, "sweep")
	if swept.Deleted != 0 || !strings.Contains(swept.Nothing, "row deletion policy") {
		t.Errorf("sweep on Spanner: %+v, want nothing to sweep, and why", swept)
	}
}

// The commands that are PostgreSQL's only, both databases at once, and a
// bad -spanner or -table, are usage errors: nothing is asked of Spanner.
func TestSpannerUsage(t *testing.T) {
	t.Setenv("SPANNER_EMULATOR_HOST", "127.0.0.1:1") // never reached
	const db = "projects/p/instances/i/databases/d"
	for _, c := range []struct {
		db   string
		args []string
		says string
	}{
		{db, []string{"stats", "-database-url", unreachableURL}, "not both"},
		{db, []string{"resolve-step", "-hash", "abc", "-step", "charge", "-not-done"}, "PostgreSQL only"},
		{db, []string{"relay", "-broker", "nats://127.0.0.1:1"}, "PostgreSQL's outbox only"},
		{"projects/p/databases/d", []string{"stats"}, "projects/P/instances/I/databases/D"},
		{db, []string{"stats", "-table", "schema.keys"}, "-table"},
	} {
		code, stdout, stderr := idemkeyCmd(t, c.db, c.args...)
		if code != exitUsage || !strings.Contains(stderr, c.says) {
			t.Errorf("idemkey %q: exit %d, stderr %q, want %d and %q", c.args, code, stderr, exitUsage, c.says)
		}
		if strings.Contains(stdout+stderr, unreachablePassword) {
			t.Errorf("idemkey %q printed the password", c.args)
		}
	}
}
