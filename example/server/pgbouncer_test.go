package main

import (
	"fmt"
	"testing"

	"github.com/idemkey/idemkey/internal/pgbouncertest"
	"github.com/idemkey/idemkey/internal/pgtest"
)

// Through pgbouncer in transaction pooling mode, with pgx's setting for such
// poolers in the URL, the server creates its tables, answers, and a second
// run replays the first run's reply, in either mode.
func TestRunThroughPgbouncer(t *testing.T) {
	for _, atomic := range []bool{false, true} {
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			schema := pgtest.Schema(t)
			b := pgbouncertest.Start(t, pgbouncertest.Config{Settings: map[string]string{"search_path": schema}})
			testRunOnPostgres(t, b.URL("default_query_exec_mode=exec"), atomic)
		})
	}
}
