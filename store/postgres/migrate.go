package postgres

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the schema as numbered files, NNN_name.up.sql and
// NNN_name.down.sql, for a migration tool of your own. They create the table
// under DefaultTable in the first schema on the search_path; for another
// name, replace idempotency_keys in them.
var Migrations fs.FS

func init() {
	var err error
	if Migrations, err = fs.Sub(migrationFiles, "migrations"); err != nil {
		panic(err) // the embedded directory exists: this cannot happen
	}
}

type migration struct {
	version  int
	name     string
	up, down string // the SQL of each direction
}

// readMigrations reads the migrations in version order: NNN_name.up.sql, each
// with its NNN_name.down.sql.
func readMigrations() ([]migration, error) {
	names, err := fs.Glob(Migrations, "*.up.sql")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, name := range names {
		number, _, _ := strings.Cut(name, "_")
		version, err := strconv.Atoi(number)
		if err != nil {
			return nil, fmt.Errorf("migration %s: name must start with its number", name)
		}
		base := strings.TrimSuffix(path.Base(name), ".up.sql")
		up, err := fs.ReadFile(Migrations, name)
		if err != nil {
			return nil, err
		}
		down, err := fs.ReadFile(Migrations, base+".down.sql")
		if err != nil {
			return nil, fmt.Errorf("migration %s: no down migration: %w", base, err)
		}
		ms = append(ms, migration{version, base, string(up), string(down)})
	}
	slices.SortFunc(ms, func(a, b migration) int { return a.version - b.version })
	return ms, nil
}

// Migrate creates or upgrades the store's table, for users without a
// migration tool of their own: it applies, in one transaction, the up
// migrations that the table "<table>_migrations" does not list yet, under the
// name and schema given by WithTable (the schema must exist). It is safe to
// call from every replica at start-up: concurrent calls wait for each other.
func Migrate(ctx context.Context, pool *pgxpool.Pool, opts ...Option) error {
	o, err := newOptions(opts)
	if err != nil {
		return err
	}
	ms, err := readMigrations()
	if err != nil {
		return fmt.Errorf("idemkey postgres: migrate: %w", err)
	}
	// Replicas creating the version table at once can collide in the catalog
	// (a unique violation, or "already exists"); a later attempt finds the
	// table, and its lock makes the rest wait for each other.
	for attempt := 1; ; attempt++ {
		err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return migrate(ctx, tx, o, ms) })
		var pgErr *pgconn.PgError
		collided := errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P07" || pgErr.Code == "42710")
		if collided && attempt < maxAttempts {
			continue
		}
		if errors.As(err, &pgErr) && statementCacheLost(pgErr.Code) {
			return fmt.Errorf("idemkey postgres: migrate: %s: %w", poolerHint, err)
		}
		if err != nil {
			return fmt.Errorf("idemkey postgres: migrate: %w", err)
		}
		return nil
	}
}

func migrate(ctx context.Context, tx pgx.Tx, o options, ms []migration) error {
	versions := o.qualified(o.table + "_migrations")
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE `+versions+` IN EXCLUSIVE MODE`); err != nil {
		return err
	}
	rows, _ := tx.Query(ctx, `SELECT version FROM `+versions)
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return err
	}
	if o.schema != "" {
		// The files name objects without a schema, and an index is always
		// created in its table's schema.
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+o.schema); err != nil {
			return err
		}
	}
	for _, m := range ms {
		if slices.Contains(applied, m.version) {
			continue
		}
		if _, err := tx.Exec(ctx, strings.ReplaceAll(m.up, DefaultTable, o.table)); err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+versions+` (version, name) VALUES ($1, $2)`, m.version, m.name); err != nil {
			return err
		}
		o.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey postgres: migration applied",
			slog.String("table", o.qualified(o.table)), slog.String("migration", m.name))
	}
	return nil
}

// MigrationState is one migration and whether the table has it.
type MigrationState struct {
	Version int
	Name    string
	Applied time.Time // zero if the migration is pending
	// Known is false for a migration the table lists that this package does
	// not have: a newer idemkey applied it.
	Known bool
}

// MigrationStatus lists this package's migrations and any others that the
// table "<table>_migrations" lists, in version order, with when each was
// applied. A table never migrated has every migration pending.
func MigrationStatus(ctx context.Context, pool *pgxpool.Pool, opts ...Option) ([]MigrationState, error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	return migrationStatus(ctx, pool, o)
}

func migrationStatus(ctx context.Context, q Querier, o options) ([]MigrationState, error) {
	ms, err := readMigrations()
	if err != nil {
		return nil, fmt.Errorf("idemkey postgres: migrations: %w", err)
	}
	states := make([]MigrationState, len(ms))
	for i, m := range ms {
		states[i] = MigrationState{Version: m.version, Name: m.name, Known: true}
	}
	versions := o.qualified(o.table + "_migrations")
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, versions).Scan(&exists); err != nil || !exists {
		return states, err
	}
	rows, _ := q.Query(ctx, `SELECT version, name, applied_at FROM `+versions)
	var a MigrationState // Known stays false
	_, err = pgx.ForEachRow(rows, []any{&a.Version, &a.Name, &a.Applied}, func() error {
		if i := slices.IndexFunc(states, func(s MigrationState) bool { return s.Version == a.Version }); i >= 0 {
			states[i].Applied = a.Applied
		} else {
			states = append(states, a)
		}
		return nil
	})
	slices.SortFunc(states, func(a, b MigrationState) int { return a.Version - b.Version })
	return states, err
}

// MigrateDown reverts the applied migrations above version to (0 reverts
// them all, dropping the table and every record in it), newest first, in one
// transaction under the lock that Migrate takes, and returns their names. It
// refuses to revert a migration this package does not know.
func MigrateDown(ctx context.Context, pool *pgxpool.Pool, to int, opts ...Option) (reverted []string, err error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	ms, err := readMigrations()
	if err != nil {
		return nil, fmt.Errorf("idemkey postgres: migrate down: %w", err)
	}
	versions := o.qualified(o.table + "_migrations")
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, versions).Scan(&exists); err != nil || !exists {
			return err // nothing was ever applied
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+versions+` IN EXCLUSIVE MODE`); err != nil {
			return err
		}
		states, err := migrationStatus(ctx, tx, o) // the lock makes this read final
		if err != nil {
			return err
		}
		if o.schema != "" {
			if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+o.schema); err != nil {
				return err
			}
		}
		for _, st := range slices.Backward(states) {
			if st.Applied.IsZero() || st.Version <= to {
				continue
			}
			i := slices.IndexFunc(ms, func(m migration) bool { return m.version == st.Version })
			if i < 0 {
				return fmt.Errorf("migration %s is unknown to this idemkey: revert it with the idemkey that applied it", st.Name)
			}
			if _, err := tx.Exec(ctx, strings.ReplaceAll(ms[i].down, DefaultTable, o.table)); err != nil {
				return fmt.Errorf("%s: %w", st.Name, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM `+versions+` WHERE version = $1`, st.Version); err != nil {
				return err
			}
			reverted = append(reverted, st.Name)
			o.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey postgres: migration reverted",
				slog.String("table", o.qualified(o.table)), slog.String("migration", st.Name))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("idemkey postgres: migrate down: %w", err)
	}
	return reverted, nil
}

// migrateHint names what creates or upgrades the table, for errors. It never
// holds the database URL: that may hold a password.
func (o options) migrateHint() string {
	cmd, call := "idemkey migrate up -database-url URL", "call postgres.Migrate"
	if o.name != DefaultTable {
		cmd += " -table " + o.name
		call += " with the same WithTable"
	}
	return "run `" + cmd + "` or " + call
}

// checkSchema is New's check: the table exists, and "<table>_migrations"
// lists every migration in ms. Without that table (a migration tool of the
// user's own), a second query checks only that the table exists, with the
// column of migration 002 and the table of steps of 003. A newer
// idemkey's migrations are accepted with a warning: an older release runs on
// the next one's schema during a rolling upgrade, and after a rollback.
func (s *Store) checkSchema(ms []migration) error {
	o := s.opts
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	table, versions := o.qualified(o.table), o.qualified(o.table+"_migrations")
	var (
		exists   bool
		applied  []int32 // the versions listed, in order
		listed   bool    // versions was read
		code     string  // the SQLSTATE of reading it, if it failed
		inSchema = true  // the table's schema exists
		waited   = true  // the table has migration 002's column
		steps    = true  // migration 003's table of steps exists
		outbox   = true  // migration 004's outbox exists
	)
	query := func() error {
		// The simple protocol prepares nothing, so that the check works
		// behind a pooler in transaction mode whatever the URL's exec mode.
		err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, coalesce(array_agg(version ORDER BY version), '{}') FROM `+versions,
			pgx.QueryExecModeSimpleProtocol, table).Scan(&exists, &applied)
		var pgErr *pgconn.PgError
		if code = ""; errors.As(err, &pgErr) {
			code = pgErr.Code
		}
		listed = err == nil
		if code == "42P01" || code == "42501" { // no such table, or no right to read it
			return s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL,
				CASE $2 WHEN '' THEN current_schema() IS NOT NULL ELSE to_regnamespace($2) IS NOT NULL END,
				EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'waited' AND NOT attisdropped),
				to_regclass($3) IS NOT NULL, to_regclass($4) IS NOT NULL`,
				pgx.QueryExecModeSimpleProtocol, table, o.schema, o.qualified(o.table+"_steps"), o.qualified(o.table+"_outbox")).
				Scan(&exists, &inSchema, &waited, &steps, &outbox)
		}
		return err
	}
	err := query()
	// A database starting up, restarting or failing over is given the
	// store's timeout to answer.
	for wait := retryPause; connectionLost(err) && store.Pause(ctx, wait); wait = min(2*wait, maxRetryPause) {
		err = query()
	}
	if err != nil {
		// Not ctx: its end would hide why no attempt succeeded.
		return s.translate(context.WithoutCancel(ctx), "New: cannot check the schema of table "+o.name, err)
	}

	if !listed {
		switch {
		case !inSchema && o.schema != "":
			return fmt.Errorf("idemkey postgres: table %s does not exist, nor does its schema %s: create the schema, then %s", o.name, o.schema, o.migrateHint())
		case !inSchema:
			return fmt.Errorf("idemkey postgres: table %s does not exist, nor does any schema on the search_path: create one or set search_path, then %s", o.name, o.migrateHint())
		case !exists:
			return fmt.Errorf("idemkey postgres: table %s does not exist: %s", o.name, o.migrateHint())
		case !waited:
			return fmt.Errorf("idemkey postgres: table %s has no column waited: apply migration 002_add_waited (in Migrations) with your migration tool, or %s", o.name, o.migrateHint())
		case !steps:
			return fmt.Errorf("idemkey postgres: table %s has no table of steps %s: apply migration 003_add_steps (in Migrations) with your migration tool, or %s",
				o.name, o.qualified(o.table+"_steps"), o.migrateHint())
		case !outbox:
			return fmt.Errorf("idemkey postgres: table %s has no outbox %s: apply migration 004_add_outbox (in Migrations) with your migration tool, or %s",
				o.name, o.qualified(o.table+"_outbox"), o.migrateHint())
		case code == "42501":
			o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey postgres: the store's role may not read "+versions+
				", so New checked only that the table exists, not that every migration of this idemkey is applied: grant it SELECT on "+versions)
		default:
			o.logger.LogAttrs(ctx, slog.LevelInfo, "idemkey postgres: no "+versions+
				": the table was made by a migration tool other than Migrate, so New checked only that it exists; applying every migration is up to that tool")
		}
		return nil
	}
	have, want := 0, ms[len(ms)-1].version
	if len(applied) > 0 {
		have = int(applied[len(applied)-1])
	}
	var missing, unknown []string
	for _, m := range ms {
		if !slices.Contains(applied, int32(m.version)) {
			missing = append(missing, m.name)
		}
	}
	for _, v := range applied {
		if !slices.ContainsFunc(ms, func(m migration) bool { return m.version == int(v) }) {
			unknown = append(unknown, strconv.Itoa(int(v)))
		}
	}
	switch {
	case !exists && len(applied) > 0:
		return fmt.Errorf("idemkey postgres: table %s does not exist, though %s lists migrations up to version %d as applied: the table was dropped; "+
			"restore it from a backup, or, to start with no records, drop %s and %s, then %s",
			o.name, versions, have, versions, o.qualified(o.table+"_token_seq"), o.migrateHint())
	case !exists:
		return fmt.Errorf("idemkey postgres: table %s does not exist (schema version 0), and this idemkey needs schema version %d: %s",
			o.name, want, o.migrateHint())
	case len(missing) > 0:
		return fmt.Errorf("idemkey postgres: table %s is at schema version %d, and this idemkey needs schema version %d (%s not applied): %s",
			o.name, have, want, strings.Join(missing, ", "), o.migrateHint())
	case len(unknown) > 0:
		o.logger.LogAttrs(ctx, slog.LevelWarn, "idemkey postgres: the table's schema is newer than this idemkey's: a newer idemkey migrated it. "+
			"This one runs on it, as a rolling upgrade or a rollback needs, but only on the schema of the next release is it promised to work",
			slog.String("table", o.name), slog.Int("schema_version", have), slog.Int("idemkey_schema_version", want),
			slog.String("unknown_versions", strings.Join(unknown, ",")))
	}
	return nil
}
