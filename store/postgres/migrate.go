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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
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
	version int
	name    string
	sql     string
}

// upMigrations reads the up migrations in version order.
func upMigrations() ([]migration, error) {
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
		sql, err := fs.ReadFile(Migrations, name)
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version, strings.TrimSuffix(path.Base(name), ".up.sql"), string(sql)})
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
	ms, err := upMigrations()
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
		if _, err := tx.Exec(ctx, strings.ReplaceAll(m.sql, DefaultTable, o.table)); err != nil {
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
