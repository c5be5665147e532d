package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"path"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkey/idemkey/store/postgres"
)

// migration is one numbered migration of postgres.Migrations, and whether
// the database has it.
type migration struct {
	Version int        `json:"version"`
	Name    string     `json:"name"`
	Applied *time.Time `json:"applied_at"` // nil: not applied
	up      bool       // this idemkey has it; false for a newer one's
	down    string     // its .down.sql
}

// migrated is the migrate command's result: what it did, then the status.
type migrated struct {
	Action     string      `json:"action"`
	Table      string      `json:"table"`
	Changed    []string    `json:"changed"` // applied by up, reverted by down
	Migrations []migration `json:"migrations"`
}

func migrateCommand(action *string) command {
	var (
		to    int
		force bool
	)
	return command{
		flags: func(fs *flag.FlagSet) {
			fs.IntVar(&to, "to", -1, "down: revert the migrations above this version (0: all); default one step")
			fs.BoolVar(&force, "force", false, "down: drop the table even when it holds records")
		},
		exec: func(ctx context.Context, e *env) (any, error) {
			m := &migrated{Action: *action, Table: e.table.given, Changed: []string{}}
			before, err := e.migrations(ctx, e.pool)
			if err != nil {
				return nil, err
			}
			switch *action {
			case "status":
			case "up":
				if err := postgres.Migrate(ctx, e.pool, postgres.WithTable(e.table.given)); err != nil {
					return nil, err
				}
			case "down":
				if m.Changed, err = e.down(ctx, to, force); err != nil {
					return nil, err
				}
			}
			if m.Migrations, err = e.migrations(ctx, e.pool); err != nil {
				return nil, err
			}
			if *action == "up" {
				for _, mg := range m.Migrations {
					if mg.Applied != nil && !slices.ContainsFunc(before, func(b migration) bool { return b.Version == mg.Version && b.Applied != nil }) {
						m.Changed = append(m.Changed, mg.Name)
					}
				}
			}
			return m, nil
		},
		human: func(w io.Writer, result any) {
			m := result.(*migrated)
			switch {
			case m.Action == "up" && len(m.Changed) == 0:
				fmt.Fprintln(w, "up to date: nothing to apply")
			case m.Action == "up":
				fmt.Fprintln(w, "applied "+strings.Join(m.Changed, ", "))
			case m.Action == "down" && len(m.Changed) == 0:
				fmt.Fprintln(w, "nothing to revert")
			case m.Action == "down":
				fmt.Fprintln(w, "reverted "+strings.Join(m.Changed, ", "))
			}
			fmt.Fprintf(w, "migrations of table %s:\n", m.Table)
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			defer tw.Flush()
			for _, mg := range m.Migrations {
				status := "pending"
				if mg.Applied != nil {
					status = "applied " + mg.Applied.UTC().Format(time.RFC3339)
				}
				if !mg.up {
					status += " (unknown to this idemkey: a newer one applied it)"
				}
				fmt.Fprintf(tw, "  %s\t%s\n", mg.Name, status)
			}
		},
	}
}

// migrations lists this idemkey's migrations and any others the database
// lists, in version order, with when each was applied. Migrate keeps the
// versions applied in the table <table>_migrations (version, name,
// applied_at), created by its first run.
func (e *env) migrations(ctx context.Context, q postgres.Querier) ([]migration, error) {
	ms, err := files()
	if err != nil {
		return nil, err
	}
	versions := e.table.sql("_migrations")
	var exists bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, versions).Scan(&exists); err != nil || !exists {
		return ms, err
	}
	rows, _ := q.Query(ctx, `SELECT version, name, applied_at FROM `+versions+` ORDER BY version`)
	var (
		version int
		name    string
		at      time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&version, &name, &at}, func() error {
		applied := at
		i := slices.IndexFunc(ms, func(m migration) bool { return m.Version == version })
		if i < 0 {
			ms = append(ms, migration{Version: version, Name: name})
			i = len(ms) - 1
		}
		ms[i].Applied = &applied
		return nil
	})
	slices.SortFunc(ms, func(a, b migration) int { return a.Version - b.Version })
	return ms, err
}

// files reads postgres.Migrations as Migrate does: NNN_name.up.sql with its
// NNN_name.down.sql.
func files() ([]migration, error) {
	names, err := fs.Glob(postgres.Migrations, "*.up.sql")
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
		down, err := fs.ReadFile(postgres.Migrations, base+".down.sql")
		if err != nil {
			return nil, fmt.Errorf("migration %s: no down migration: %w", base, err)
		}
		ms = append(ms, migration{Version: version, Name: base, up: true, down: string(down)})
	}
	slices.SortFunc(ms, func(a, b migration) int { return a.Version - b.Version })
	return ms, nil
}

// down reverts the applied migrations above version to (one step if to < 0),
// newest first, in one transaction under the lock Migrate takes, and removes
// them from the bookkeeping as Migrate adds them. It returns their names.
func (e *env) down(ctx context.Context, to int, force bool) ([]string, error) {
	versions := e.table.sql("_migrations")
	var exists bool
	if err := e.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, versions).Scan(&exists); err != nil || !exists {
		return []string{}, err // nothing was ever applied
	}
	reverted := []string{}
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `LOCK TABLE `+versions+` IN EXCLUSIVE MODE`); err != nil {
			return err
		}
		ms, err := e.migrations(ctx, tx) // the lock makes this read final
		if err != nil {
			return err
		}
		var undo []migration
		for _, m := range slices.Backward(ms) {
			if m.Applied == nil || (to >= 0 && m.Version <= to) || (to < 0 && len(undo) == 1) {
				continue
			}
			if !m.up {
				return &cmdError{code: exitRefused, kind: "refused", message: fmt.Sprintf(
					"migration %s is unknown to this idemkey: revert it with the idemkey that applied it", m.Name)}
			}
			undo = append(undo, m)
		}
		if len(undo) == 0 {
			return nil
		}
		var table *string
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1)::text`, e.table.sql("")).Scan(&table); err != nil {
			return err
		}
		if table != nil && !force {
			var n int64
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+e.table.sql("")).Scan(&n); err != nil {
				return err
			}
			if n > 0 {
				return &cmdError{code: exitRefused, kind: "refused", message: fmt.Sprintf(
					"table %s holds %d records: reverting drops them, and retries of their calls run again; use -force", e.table.given, n)}
			}
		}
		if e.table.schema != "" {
			// As in Migrate: the files name objects without a schema.
			if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+e.table.schema); err != nil {
				return err
			}
		}
		for _, m := range undo {
			if _, err := tx.Exec(ctx, strings.ReplaceAll(m.down, postgres.DefaultTable, e.table.name)); err != nil {
				return fmt.Errorf("%s: %w", m.Name, err)
			}
			if _, err := tx.Exec(ctx, `DELETE FROM `+versions+` WHERE version = $1`, m.Version); err != nil {
				return err
			}
			reverted = append(reverted, m.Name)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return reverted, nil
}
