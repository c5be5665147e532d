package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// migration is one migration of the store, and whether the database has it.
type migration struct {
	Version   int        `json:"version"`
	Name      string     `json:"name"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at"` // nil: not applied, or on Spanner, which keeps no time
	Known     bool       `json:"known"`      // false for one a newer idemkey applied
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
			m := &migrated{Action: *action, Table: e.table, Changed: []string{}}
			before, err := e.db.migrations(ctx)
			if err != nil {
				return nil, err
			}
			switch *action {
			case "status":
			case "up":
				if err := e.db.migrateUp(ctx); err != nil {
					return nil, err
				}
			case "down":
				if m.Changed, err = e.down(ctx, before, to, force); err != nil {
					return nil, err
				}
			}
			if m.Migrations, err = e.db.migrations(ctx); err != nil {
				return nil, err
			}
			if *action == "up" {
				for _, mg := range m.Migrations {
					if mg.Applied && !slices.ContainsFunc(before, func(b migration) bool { return b.Version == mg.Version && b.Applied }) {
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
				switch {
				case mg.AppliedAt != nil:
					status = "applied " + mg.AppliedAt.UTC().Format(time.RFC3339)
				case mg.Applied:
					status = "applied"
				}
				if !mg.Known {
					status += " (unknown to this idemkey: a newer one applied it)"
				}
				fmt.Fprintf(tw, "  %s\t%s\n", mg.Name, status)
			}
		},
	}
}

// down reverts the applied migrations above version to, or the newest one if
// to < 0 (postgres.MigrateDown, spanner.MigrateDown). Reverting the first drops the table, and
// with it every recorded reply, so that is refused while the table holds
// records, unless force.
func (e *env) down(ctx context.Context, status []migration, to int, force bool) ([]string, error) {
	if to < 0 {
		to = 0
		for _, m := range slices.Backward(status) {
			if m.Applied {
				to = m.Version - 1
				break
			}
		}
	}
	first := slices.IndexFunc(status, func(m migration) bool { return m.Applied })
	if first >= 0 && to < status[first].Version && !force {
		var st stats
		if err := e.db.stats(ctx, &st); err != nil && !e.db.missingTable(err) {
			return nil, err
		}
		if n := st.Completed + st.InProgress; n > 0 {
			return nil, &cmdError{code: exitRefused, kind: "refused", message: fmt.Sprintf(
				"table %s holds %d records: reverting drops them, and retries of their calls run again; use -force", e.table, n)}
		}
	}
	reverted, err := e.db.migrateDown(ctx, to)
	if reverted == nil {
		reverted = []string{}
	}
	return reverted, err
}
