package spanner

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"regexp"
	"slices"
	"strings"

	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the schema as numbered files, NNN_name.up.sql and
// NNN_name.down.sql, for a migration tool of your own: Spanner DDL, one
// statement after each semicolon. They create the tables under DefaultTable;
// for another name, replace idempotency_keys in them.
var Migrations fs.FS

func init() {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	Migrations = sub
}

var createTable = regexp.MustCompile(`(?i)^CREATE TABLE\s+` + "`?" + `(\w+)`)

// Migrate creates the store's tables in database (projects/P/instances/I/databases/D),
// for users without a migration tool of their own, under the name WithTable
// gives. A migration counts as applied when every table it creates exists,
// so Migrate is safe to run at every start-up; two runs at once may both
// try, and the second fails with Spanner's "duplicate name" error.
func Migrate(ctx context.Context, admin *database.DatabaseAdminClient, database string, opts ...Option) error {
	o, err := newOptions(opts)
	if err != nil {
		return err
	}
	ddl, err := admin.GetDatabaseDdl(ctx, &databasepb.GetDatabaseDdlRequest{Database: database})
	if err != nil {
		return fmt.Errorf("idemkey spanner: migrate: read the schema: %w", err)
	}
	tables := map[string]bool{}
	for _, st := range ddl.GetStatements() {
		if m := createTable.FindStringSubmatch(strings.TrimSpace(st)); m != nil {
			tables[strings.ToLower(m[1])] = true
		}
	}
	names, err := fs.Glob(Migrations, "*.up.sql")
	if err != nil {
		return err
	}
	slices.Sort(names)
	var pending []string
	for _, name := range names {
		b, err := fs.ReadFile(Migrations, name)
		if err != nil {
			return err
		}
		statements := splitDDL(strings.ReplaceAll(string(b), DefaultTable, o.table))
		applied := true
		for _, st := range statements {
			if m := createTable.FindStringSubmatch(st); m != nil && !tables[strings.ToLower(m[1])] {
				applied = false
			}
		}
		if !applied {
			pending = append(pending, statements...)
		}
	}
	if len(pending) == 0 {
		return nil
	}
	op, err := admin.UpdateDatabaseDdl(ctx, &databasepb.UpdateDatabaseDdlRequest{Database: database, Statements: pending})
	if err == nil {
		err = op.Wait(ctx)
	}
	if err != nil {
		return fmt.Errorf("idemkey spanner: migrate: %w", err)
	}
	return nil
}

// splitDDL returns the statements of a migration file, without comments.
func splitDDL(text string) []string {
	var b strings.Builder
	for line := range strings.Lines(text) {
		if code, _, _ := strings.Cut(line, "--"); strings.TrimSpace(code) != "" {
			b.WriteString(code)
			b.WriteString("\n")
		}
	}
	var statements []string
	for st := range strings.SplitSeq(b.String(), ";") {
		if st = strings.TrimSpace(st); st != "" {
			statements = append(statements, st)
		}
	}
	return statements
}
