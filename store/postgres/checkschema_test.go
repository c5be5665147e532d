package postgres

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/idemkey/idemkey/internal/pgtest"
)

// A table migrated by an older idemkey, which lacks a migration of this one,
// fails the check, naming both schema versions, the migration and the
// command. The test adds one after this idemkey's last to those the check
// expects.
func TestCheckSchemaOfAnOlderTable(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	for _, table := range []string{DefaultTable, "older_keys"} {
		if err := Migrate(context.Background(), pool, WithTable(table)); err != nil {
			t.Fatal(err)
		}
		st, err := New(pool, WithTable(table))
		if err != nil {
			t.Fatal(err)
		}
		ms, err := readMigrations()
		if err != nil {
			t.Fatal(err)
		}
		have := ms[len(ms)-1].version
		next := migration{version: have + 1, name: fmt.Sprintf("%03d_next", have+1)}
		err = st.checkSchema(append(ms, next))
		want := fmt.Sprintf("table %s is at schema version %d, and this idemkey needs schema version %d (%s not applied): run `idemkey migrate up -database-url URL",
			table, have, next.version, next.name)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("check of a table without migration %s: %v\nwant %q in it", next.name, err, want)
		}
	}
}
