package postgres_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/pgbouncertest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// bouncedPools returns an openPool whose pools go through a pgbouncer in
// transaction pooling mode, one per schema, with pgx's query exec mode set in
// the URL. A pool's runtime parameters, which pgbouncer does not pass on,
// become the settings of pgbouncer's server connections instead (as a
// database's or a role's settings would be), but for application_name.
func bouncedPools(mode string, poolSize int) func(testing.TB, string, ...func(*pgxpool.Config)) *pgxpool.Pool {
	var (
		mu       sync.Mutex // the conformance suite runs in parallel
		bouncers = map[string]*pgbouncertest.Bouncer{}
	)
	return func(tb testing.TB, schema string, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
		tb.Helper()
		mu.Lock()
		defer mu.Unlock()
		b := bouncers[schema]
		if b == nil {
			probe, _ := pgxpool.ParseConfig("postgres://localhost/test")
			for _, f := range configure {
				f(probe)
			}
			settings := map[string]string{"search_path": schema}
			for name, value := range probe.ConnConfig.RuntimeParams {
				if name != "application_name" {
					settings[name] = value
				}
			}
			b = pgbouncertest.Start(tb, pgbouncertest.Config{Settings: settings, PoolSize: poolSize})
			bouncers[schema] = b
			tb.Cleanup(func() { mu.Lock(); delete(bouncers, schema); mu.Unlock() })
		}
		cfg, err := pgxpool.ParseConfig(b.URL("default_query_exec_mode=" + mode))
		if err != nil {
			tb.Fatal(err)
		}
		cfg.ConnConfig.RuntimeParams["search_path"] = schema // pgbouncer ignores it; schemaOf reads it
		for _, f := range configure {
			f(cfg)
		}
		for name := range cfg.ConnConfig.RuntimeParams {
			if name != "application_name" && name != "search_path" {
				delete(cfg.ConnConfig.RuntimeParams, name)
			}
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(pool.Close)
		return pool
	}
}

// TestPgbouncer runs the store's conformance suite and the tests of its gRPC
// paths, two-phase and atomic, through pgbouncer in transaction pooling mode,
// which keeps no prepared statement and no session state between
// transactions, with pgx set for such poolers in the URL
// (default_query_exec_mode=exec, and for some simple_protocol).
// TestAtomicSessionLockTimeout is left out: behind a transaction pooler a
// session has no settings of its own to keep.
func TestPgbouncer(t *testing.T) {
	tests := []struct {
		name      string
		run       func(*testing.T)
		simpleToo bool // also with simple_protocol
	}{
		{"Conformance", TestConformance, true},
		{"ReplicasRace", TestReplicasRace, false},
		{"SerializableDefault", TestSerializableDefault, false},
		{"RoundTripsPerCall", TestRoundTripsPerCall, false},
		{"RetryReplaysWithARead", TestRetryReplaysWithARead, true},
		{"ReplayWhileAtomicHandlersHoldThePool", TestReplayWhileAtomicHandlersHoldThePool, false},
		{"IdleConnectionsTerminatedMidCalls", TestIdleConnectionsTerminatedMidCalls, false},
		{"AtomicOutcomes", TestAtomicOutcomes, true},
		{"AtomicHandlerMisuse", TestAtomicHandlerMisuse, false},
		{"AtomicDuplicateWhileOpen", TestAtomicDuplicateWhileOpen, false},
		{"AtomicDuplicateWaits", TestAtomicDuplicateWaits, false},
		{"AtomicTerminatedBackend", TestAtomicTerminatedBackend, false},
		{"AtomicStorm", TestAtomicStorm, false},
		{"AtomicRoundTrips", TestAtomicRoundTrips, false},
		{"AtomicExpires", TestAtomicExpires, true},
		{"AtomicDuplicateToldTheRecordsExpiry", TestAtomicDuplicateToldTheRecordsExpiry, true},
		{"AtomicDuplicateToldTheKeysExpiry", TestAtomicDuplicateToldTheKeysExpiry, false},
		{"BatchDecisions", TestBatchDecisions, true},
		{"BatchCallsApart", TestBatchCallsApart, true},
		{"BatchRoundTrips", TestBatchRoundTrips, false},
		{"BatchUnparsableStatement", TestBatchUnparsableStatement, true},
		{"BatchUnsentStatement", TestBatchUnsentStatement, true},
		{"BatchCommitLost", TestBatchCommitLost, false},
		{"BatchHandlerCommits", TestBatchHandlerCommits, false},
	}
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			defer func(direct func(testing.TB, string, ...func(*pgxpool.Config)) *pgxpool.Pool) { openPool = direct }(openPool)
			openPool = bouncedPools(mode, 0)
			for _, tc := range tests {
				if mode == "exec" || tc.simpleToo {
					t.Run(tc.name, tc.run)
				}
			}
		})
	}
}

// With pgx's default statement cache, pgbouncer in transaction mode hands a
// statement prepared on one client's server connection to another client:
// Migrate, the store and a call through the interceptor fail with an error
// that names the setting of the URL that fixes it, and the call fails closed.
func TestPgbouncerWithoutExecMode(t *testing.T) {
	schema := pgtest.Schema(t)
	// One server connection, shared by every client: the second client to
	// prepare a statement finds it prepared (SQLSTATE 42P05).
	b := pgbouncertest.Start(t, pgbouncertest.Config{Settings: map[string]string{"search_path": schema}, PoolSize: 1})
	open := func() *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(b.URL())
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 1
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	wantHint := func(what string, err error) {
		t.Helper()
		switch msg := err.Error(); {
		case !strings.Contains(msg, "default_query_exec_mode=exec"):
			t.Errorf("%s: %v; want it to name default_query_exec_mode=exec", what, err)
		case what != "Migrate" && (strings.Contains(msg, "42P05") || strings.Contains(msg, "stmtcache")):
			t.Errorf("%s: %v; want no raw SQLSTATE or statement name", what, err)
		}
	}
	ctx := context.Background()
	first, second := open(), open()
	if err := postgres.Migrate(ctx, first); err != nil {
		t.Fatalf("the first Migrate: %v", err)
	}
	if err := postgres.Migrate(ctx, second); err == nil {
		t.Error("the second Migrate through the shared server connection succeeded; the test did not provoke the failure")
	} else {
		wantHint("Migrate", err)
	}

	r := store.Reservation{Key: store.ScopeKey("t", "/m", "k"), Fingerprint: fpA, Lease: lease, Retention: retention}
	if _, err := newStore(t, first).Reserve(ctx, r); err != nil {
		t.Fatalf("the first store's Reserve: %v", err)
	}
	st := newStore(t, second)
	r.Key = store.ScopeKey("t", "/m", "other")
	if _, err := st.Reserve(ctx, r); err == nil {
		t.Error("the second store's Reserve succeeded; the test did not provoke the failure")
	} else {
		wantHint("Reserve", err)
	}

	client, svc := serveCharges(t, st)
	err := createCharge(client, "k")
	if status.Code(err) != codes.Unavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
		t.Errorf("call: %v, want Unavailable %s", err, idemkey.ReasonStoreUnavailable)
	}
	if n := svc.runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times without its reservation", n)
	}
}

// Atomic calls through pgbouncer, on one server connection that every client
// shares, leave nothing in that session for the next client: the handler
// and the next client see the database's lock_timeout, and no advisory lock
// or prepared statement is left.
func TestPgbouncerLeavesNoSessionState(t *testing.T) {
	defer func(direct func(testing.TB, string, ...func(*pgxpool.Config)) *pgxpool.Pool) { openPool = direct }(openPool)
	openPool = bouncedPools("exec", 1)
	r := newAtomicReplicas(t, 1, nil)[0]
	var want string
	if err := r.pool.QueryRow(context.Background(), `SELECT current_setting('lock_timeout')`).Scan(&want); err != nil {
		t.Fatal(err)
	}
	for _, customer := range []string{"ok", "recorded", "released", "lock_timeout"} {
		c, err := r.charge(idemkey.NewKey(), customer)
		if customer == "lock_timeout" && (err != nil || c.GetDescription() != want) {
			t.Errorf("the handler's lock_timeout: %q, %v; want the database's %q", c.GetDescription(), err, want)
		}
	}
	if _, err := r.charge("replayed", "ok"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.charge("replayed", "ok"); err != nil {
		t.Fatal(err)
	}

	next := openPool(t, schemaOf(t, r.pool))
	var (
		lockTimeout     string
		locks, prepared int
	)
	err := next.QueryRow(context.Background(), `SELECT current_setting('lock_timeout'),
		(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
		(SELECT count(*) FROM pg_prepared_statements)`).Scan(&lockTimeout, &locks, &prepared)
	if err != nil {
		t.Fatal(err)
	}
	if lockTimeout != want || locks != 0 || prepared != 0 {
		t.Errorf("the next client's session: lock_timeout %q, %d advisory locks, %d prepared statements; want %q, 0, 0",
			lockTimeout, locks, prepared, want)
	}
}

// BenchmarkExecMode measures what pgx's exec mode, which a transaction
// pooler needs, costs a first call (Reserve, then Complete) and a replay
// (Reserve), interleaved: directly with pgx's default statement cache,
// directly in exec mode, and through pgbouncer in transaction mode in exec
// mode. It reports each one's time and its ratio to the statement cache.
func BenchmarkExecMode(b *testing.B) {
	schema := pgtest.Schema(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cached := pgtest.Pool(b, schema)
	if err := postgres.Migrate(ctx, cached); err != nil {
		b.Fatal(err)
	}
	exec := pgtest.Pool(b, schema, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec })
	bouncer := pgbouncertest.Start(b, pgbouncertest.Config{Settings: map[string]string{"search_path": schema}})
	cfg, err := pgxpool.ParseConfig(bouncer.URL("default_query_exec_mode=exec"))
	if err != nil {
		b.Fatal(err)
	}
	bounced, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer bounced.Close()

	fp := store.Fingerprint{1}
	names := []string{"cache", "exec", "pgbouncer-exec"}
	var firsts, replays []benchtest.Op
	for i, pool := range []*pgxpool.Pool{cached, exec, bounced} {
		st := newStore(b, pool)
		recorded := benchKey("replay-"+names[i], 0)
		if err := first(ctx, st, recorded, fp); err != nil {
			b.Fatal(err)
		}
		firsts = append(firsts, benchtest.Op{Name: names[i] + "-first", Run: func(n int) error {
			return first(ctx, st, benchKey("first-"+names[i], n), fp)
		}})
		replays = append(replays, benchtest.Op{Name: names[i] + "-replay", Run: func(int) error {
			return replay(ctx, st, recorded, fp)
		}})
	}
	ns := benchtest.Interleave(b, append(firsts, replays...)...)
	b.ReportMetric(ns[1]/ns[0], "exec-first/cache")
	b.ReportMetric(ns[2]/ns[0], "pgbouncer-first/cache")
	b.ReportMetric(ns[4]/ns[3], "exec-replay/cache")
	b.ReportMetric(ns[5]/ns[3], "pgbouncer-replay/cache")
}
