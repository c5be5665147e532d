package spanner

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"regexp"
	"slices"
	"strconv"
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

// migration is one of Migrations, its statements naming the store's table.
type migration struct {
	version  int
	name     string // NNN_name
	up, down []string
	tables   []string // the tables up creates, lower case
}

// readMigrations reads Migrations in version order, for the table name.
func readMigrations(table string) ([]migration, error) {
	names, err := fs.Glob(Migrations, "*.up.sql")
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	ms := make([]migration, len(names))
	for i, name := range names {
		m := &ms[i]
		m.name = strings.TrimSuffix(name, ".up.sql")
		number, _, _ := strings.Cut(m.name, "_")
		if m.version, err = strconv.Atoi(number); err != nil {
			return nil, fmt.Errorf("migration %s: name must start with its number", name)
		}
		for dir, statements := range map[string]*[]string{".up.sql": &m.up, ".down.sql": &m.down} {
			b, err := fs.ReadFile(Migrations, m.name+dir)
			if err != nil {
				return nil, err
			}
			*statements = splitDDL(strings.ReplaceAll(string(b), DefaultTable, table))
		}
		for _, st := range m.up {
			if t := createTable.FindStringSubmatch(st); t != nil {
				m.tables = append(m.tables, strings.ToLower(t[1]))
			}
		}
	}
	return ms, nil
}

// applied reports whether every table m creates is among tables.
func (m migration) applied(tables map[string]bool) bool {
	for _, t := range m.tables {
		if !tables[t] {
			return false
		}
	}
	return true
}

// schema reads the migrations for o's table and the names of database's
// tables, lower case, from its DDL.
func schema(ctx context.Context, admin *database.DatabaseAdminClient, database string, o options) ([]migration, map[string]bool, error) {
	ms, err := readMigrations(o.table)
	if err != nil {
		return nil, nil, err
	}
	ddl, err := admin.GetDatabaseDdl(ctx, &databasepb.GetDatabaseDdlRequest{Database: database})
	if err != nil {
		return nil, nil, fmt.Errorf("read the schema: %w", err)
	}
	tables := map[string]bool{}
	for _, st := range ddl.GetStatements() {
		if m := createTable.FindStringSubmatch(strings.TrimSpace(st)); m != nil {
			tables[strings.ToLower(m[1])] = true
		}
	}
	return ms, tables, nil
}

// updateDDL runs statements, and waits for them.
func updateDDL(ctx context.Context, admin *database.DatabaseAdminClient, database string, statements []string) error {
	op, err := admin.UpdateDatabaseDdl(ctx, &databasepb.UpdateDatabaseDdlRequest{Database: database, Statements: statements})
	if err == nil {
		err = op.Wait(ctx)
	}
	return err
}

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
	ms, tables, err := schema(ctx, admin, database, o)
	if err != nil {
		return fmt.Errorf("idemkey spanner: migrate: %w", err)
	}
	var pending []string
	for _, m := range ms {
		if !m.applied(tables) {
			pending = append(pending, m.up...)
		}
	}
	if len(pending) == 0 {
		return nil
	}
	if err := updateDDL(ctx, admin, database, pending); err != nil {
		return fmt.Errorf("idemkey spanner: migrate: %w", err)
	}
	return nil
}

// MigrationState is one migration and whether the database has it, as
// store/postgres's is, but without the time it was applied: Spanner's schema
// does not keep it. A migration counts as applied when every table it
// creates exists.
type MigrationState struct {
	Version int
	Name    string
	Applied bool
}

// MigrationStatus lists the migrations in version order, each applied or
// not, from one read of database's schema.
func MigrationStatus(ctx context.Context, admin *database.DatabaseAdminClient, database string, opts ...Option) ([]MigrationState, error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	ms, tables, err := schema(ctx, admin, database, o)
	if err != nil {
		return nil, fmt.Errorf("idemkey spanner: migration status: %w", err)
	}
	states := make([]MigrationState, len(ms))
	for i, m := range ms {
		states[i] = MigrationState{Version: m.version, Name: m.name, Applied: m.applied(tables)}
	}
	return states, nil
}

// MigrateDown reverts the applied migrations above version to (0 reverts
// them all, dropping the tables and every record in them), newest first, in
// one schema update, and returns their names. Spanner applies a schema
// update's statements one by one: if one fails, those before it stay done,
// and MigrationStatus tells where the schema is.
func MigrateDown(ctx context.Context, admin *database.DatabaseAdminClient, database string, to int, opts ...Option) (reverted []string, err error) {
	o, err := newOptions(opts)
	if err != nil {
		return nil, err
	}
	ms, tables, err := schema(ctx, admin, database, o)
	if err != nil {
		return nil, fmt.Errorf("idemkey spanner: migrate down: %w", err)
	}
	var statements []string
	for _, m := range slices.Backward(ms) {
		if m.version > to && m.applied(tables) {
			statements = append(statements, m.down...)
			reverted = append(reverted, m.name)
		}
	}
	if len(statements) == 0 {
		return nil, nil
	}
	if err := updateDDL(ctx, admin, database, statements); err != nil {
		return nil, fmt.Errorf("idemkey spanner: migrate down: %w", err)
	}
	return reverted, nil
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
