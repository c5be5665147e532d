package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// latestMigration is the version of the newest migration this idemkey has.
func latestMigration(t *testing.T) int {
	t.Helper()
	states, err := postgres.MigrationStatus(context.Background(), pgtest.Pool(t, pgtest.Schema(t)))
	if err != nil || len(states) == 0 {
		t.Fatalf("MigrationStatus = %v, %v", states, err)
	}
	return states[len(states)-1].Version
}

// wantNewFails checks that New fails with an error holding each of want,
// and the command that migrates the table.
func wantNewFails(t *testing.T, pool *pgxpool.Pool, table string, want ...string) {
	t.Helper()
	_, err := postgres.New(pool, postgres.WithTable(table))
	if err == nil {
		t.Fatalf("%s: New succeeded, want it to fail naming %q", table, want)
	}
	command := "run `idemkey migrate up -database-url URL` or call postgres.Migrate"
	if table != postgres.DefaultTable {
		command = "run `idemkey migrate up -database-url URL -table " + table + "` or call postgres.Migrate with the same WithTable"
	}
	for _, w := range append(want, command) {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: New: %v\nwant %q in it", table, err, w)
		}
	}
	if errors.Is(err, store.ErrUnavailable) {
		t.Errorf("%s: New: %v matches store.ErrUnavailable, though the database answered", table, err)
	}
}

// A forgotten migration fails New, at start-up, with the command that fixes
// it: on an empty schema, and after MigrateDown, for the default table and
// for one named by WithTable in a schema of its own. After Migrate, New
// succeeds.
func TestNewChecksTheSchema(t *testing.T) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t, schema)
	latest := latestMigration(t)
	for _, table := range []string{postgres.DefaultTable, schema + ".other_keys"} {
		opt := postgres.WithTable(table)
		wantNewFails(t, pool, table, "table "+table+" does not exist")

		if err := postgres.Migrate(ctx, pool, opt); err != nil {
			t.Fatal(err)
		}
		st, err := postgres.New(pool, opt)
		if err != nil {
			t.Fatalf("%s: New after Migrate: %v", table, err)
		}
		acquire(t, st, store.ScopeKey("t", "/m", "k"))

		if _, err := postgres.MigrateDown(ctx, pool, 0, opt); err != nil {
			t.Fatal(err)
		}
		wantNewFails(t, pool, table, "table "+table+" does not exist (schema version 0)",
			fmt.Sprintf("this idemkey needs schema version %d", latest))
	}
	_, err := postgres.New(pool, postgres.WithTable("nowhere.keys"))
	if err == nil || !strings.Contains(err.Error(), "nor does its schema nowhere: create the schema, then run `idemkey migrate up") {
		t.Errorf("New of a table in a schema that does not exist: %v", err)
	}
}

// A table dropped after Migrate is told apart from one never migrated: Migrate
// would not make it again while its migrations are listed.
func TestNewOnADroppedTable(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys does not exist, though idempotency_keys_migrations lists migrations",
		"restore it from a backup, or, to start with no records, drop idempotency_keys_migrations and idempotency_keys_token_seq, then")
}

// A table migrated by a newer idemkey is accepted, with a warning naming both
// versions: during a rolling upgrade, the older release's replicas must still
// start on the schema the newer one migrated.
func TestNewAcceptsANewerSchema(t *testing.T) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	pool := pgtest.Pool(t, schema)
	latest := latestMigration(t)
	table := schema + ".keys"
	if err := postgres.Migrate(ctx, pool, postgres.WithTable(table)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+table+`_migrations (version, name) VALUES ($1, $2)`,
		latest+1, fmt.Sprintf("%03d_from_a_newer_idemkey", latest+1)); err != nil {
		t.Fatal(err)
	}
	logger, logs := logtest.New()
	st, err := postgres.New(pool, postgres.WithTable(table), postgres.WithLogger(logger))
	if err != nil {
		t.Fatalf("New on a schema one migration ahead: %v", err)
	}
	acquire(t, st, store.ScopeKey("t", "/m", "k"))
	for _, want := range []string{"level=WARN", "newer than this idemkey's", "table=" + table,
		fmt.Sprintf("schema_version=%d", latest+1), fmt.Sprintf("idemkey_schema_version=%d", latest)} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("New logged %q, want %q in it", logs.String(), want)
		}
	}
}

// A table made from Migrations by a migration tool of the user's own has no
// version table: New checks that it exists, takes it, and says that it
// checked no more; without it, New fails.
func TestNewOnATableOfAnotherTool(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	names, err := fs.Glob(postgres.Migrations, "*.up.sql")
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range names {
		sql, err := fs.ReadFile(postgres.Migrations, name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, string(sql)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		switch i {
		case 0: // a tool that applied the first migration only
			wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys has no column waited: apply migration 002_add_waited")
		case 1:
			wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys has no table of steps idempotency_keys_steps: apply migration 003_add_steps")
		}
	}
	logger, logs := logtest.New()
	if _, err := postgres.New(pool, postgres.WithLogger(logger)); err != nil {
		t.Errorf("New on a table made from Migrations: %v", err)
	}
	if !strings.Contains(logs.String(), "no idempotency_keys_migrations") {
		t.Errorf("New logged %q, want it to say that it checked only that the table exists", logs.String())
	}
	if _, err := pool.Exec(ctx, `DROP TABLE idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys does not exist")
}

// A role that may use the table but not read its version table still gets a
// store: New checks that the table exists, and warns that it could not check
// the migrations.
func TestNewWithoutTheRightToReadVersions(t *testing.T) {
	ctx := context.Background()
	schema := pgtest.Schema(t)
	admin := pgtest.Pool(t, schema)
	if err := postgres.Migrate(ctx, admin); err != nil {
		t.Fatal(err)
	}
	app := unprivilegedPool(t, admin)
	logger, logs := logtest.New()
	st, err := postgres.New(app, postgres.WithLogger(logger))
	if err != nil {
		t.Fatalf("New as a role that may not read the version table: %v", err)
	}
	acquire(t, st, store.ScopeKey("t", "/m", "k"))
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "grant it SELECT on idempotency_keys_migrations") {
		t.Errorf("New logged %q, want a warning that the migrations were not checked", logs.String())
	}
}

// New checks the schema in one round trip.
func TestNewChecksInOneRoundTrip(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	tracer := &roundTrips{}
	traced := pgtest.Pool(t, schemaOf(t, pool), func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	newStore(t, traced)
	if trips, prepares := tracer.reset(); trips != 1 || prepares != 0 {
		t.Errorf("New made %d round trips and %d prepares, want 1 and 0", trips, prepares)
	}
}

// A database that cannot be reached fails New, within its timeout, with an
// error that says the schema could not be checked, matches
// store.ErrUnavailable, and holds neither the password nor the host.
func TestNewOnAnUnreachableDatabase(t *testing.T) {
	const password = "s3cret-pw-9d1f"
	pool, err := pgxpool.New(context.Background(), "postgres://app:"+password+"@127.0.0.1:1/test?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	start := time.Now()
	_, err = postgres.New(pool, postgres.WithTimeout(300*time.Millisecond))
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("New took %v with a timeout of 300ms", took)
	}
	if err == nil {
		t.Fatal("New on an unreachable database succeeded")
	}
	if !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "cannot check the schema of table idempotency_keys") {
		t.Errorf("New: %v, want store.ErrUnavailable, saying the schema could not be checked", err)
	}
	wantTranslated(t, err, true)
	for _, secret := range []string{password, "127.0.0.1", "app@"} {
		if strings.Contains(err.Error(), secret) {
			t.Errorf("New: %v holds %q", err, secret)
		}
	}
}

// A table migrated by the idemkey before recorded steps (schema version 2)
// fails New, naming the migration of the steps' table and the command.
func TestNewWithoutTheStepsMigration(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if reverted, err := postgres.MigrateDown(ctx, pool, 2); err != nil || strings.Join(reverted, " ") != "004_add_outbox 003_add_steps" {
		t.Fatalf("MigrateDown to 2 = %v, %v; want 004_add_outbox and 003_add_steps reverted", reverted, err)
	}
	wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys is at schema version 2, and this idemkey needs schema version 4 (003_add_steps, 004_add_outbox not applied)")
}

// A table migrated by the idemkey before the outbox (schema version 3)
// fails New, naming the outbox's migration; without the migrations' list
// (a table made by another tool), the missing outbox table is named.
func TestNewWithoutTheOutboxMigration(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if reverted, err := postgres.MigrateDown(ctx, pool, 3); err != nil || strings.Join(reverted, " ") != "004_add_outbox" {
		t.Fatalf("MigrateDown to 3 = %v, %v; want 004_add_outbox reverted", reverted, err)
	}
	wantNewFails(t, pool, postgres.DefaultTable, "table idempotency_keys is at schema version 3, and this idemkey needs schema version 4 (004_add_outbox not applied)")
	if _, err := pool.Exec(ctx, `DROP TABLE idempotency_keys_migrations`); err != nil {
		t.Fatal(err)
	}
	wantNewFails(t, pool, postgres.DefaultTable, "has no outbox idempotency_keys_outbox: apply migration 004_add_outbox")
}
