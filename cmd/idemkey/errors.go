package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkey/idemkey/store/postgres"
)

// cmdError is a failure with an exit code of its own.
type cmdError struct {
	code    int
	kind    string // for -json: not_found, usage, ambiguous, refused, database
	message string
	matches []match // for ambiguous
}

func (e *cmdError) Error() string { return e.message }

func usageError(format string, args ...any) error {
	return &cmdError{code: exitUsage, kind: "usage", message: fmt.Sprintf(format, args...)}
}

// fail reports err and returns its exit code. Errors that are not a
// cmdError came from the database.
func fail(err error, c *common, e *env, stdout, stderr io.Writer) int {
	var ce *cmdError
	if !errors.As(err, &ce) {
		ce = &cmdError{code: exitDatabase, kind: "database", message: describe(err, c)}
	}
	password := ""
	if e != nil {
		password = e.password
	}
	ce.message = scrubbed(ce.message, password)
	if c.json {
		writeJSON(stdout, struct {
			Error   string  `json:"error"`
			Message string  `json:"message"`
			Matches []match `json:"matches,omitempty"`
		}{ce.kind, ce.message, ce.matches})
		return ce.code
	}
	fmt.Fprintln(stderr, "idemkey: "+ce.message)
	for _, m := range ce.matches {
		fmt.Fprintf(stderr, "  %s  %-11s created %s\n", m.Hash, m.State, m.Created.UTC().Format(time.RFC3339))
	}
	return ce.code
}

// missingRelation reports whether err is PostgreSQL's "relation does not
// exist" (SQLSTATE 42P01).
func missingRelation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}

// describe says what went wrong with the database, without the driver's
// connection details.
func describe(err error, c *common) string {
	var (
		pgErr      *pgconn.PgError
		connectErr *pgconn.ConnectError
	)
	if msg, ok := describeSpanner(err, c); ok {
		return msg
	}
	switch {
	case missingRelation(err):
		return missingTable(c.table, c.spanner)
	case errors.As(err, &pgErr):
		return fmt.Sprintf("the database answered: %s (SQLSTATE %s)", pgErr.Message, pgErr.Code)
	case errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err):
		return fmt.Sprintf("the database did not answer within -timeout %s", c.timeout)
	case errors.Is(err, context.Canceled):
		return "interrupted"
	case errors.As(err, &connectErr):
		// One line per address tried, often the same twice (with and
		// without TLS): each once.
		var lines []string
		for _, l := range strings.Split(fmt.Sprint(errors.Unwrap(connectErr)), "\n") {
			if !slices.Contains(lines, l) {
				lines = append(lines, l)
			}
		}
		return fmt.Sprintf("cannot connect to the database at %s: %s", redactedURL(c.databaseURL), strings.Join(lines, "; "))
	}
	return "database: " + err.Error()
}

func missingTable(name, spanner string) string {
	return fmt.Sprintf("table %s not found: %s", name, migrateUp(name, spanner))
}

// migrateUp is the command that migrates the store's table name, on the
// Spanner database spanner if not "" (else the -database-url's).
func migrateUp(name, spanner string) string {
	hint := "run idemkey migrate up"
	if spanner != "" {
		hint += " -spanner " + spanner
	}
	if name != postgres.DefaultTable {
		hint += " -table " + name
		if strings.Contains(name, ".") {
			hint += " (the schema must exist)"
		}
	}
	return hint
}

var passwordParam = regexp.MustCompile(`(?i)password=\S*`)

// redactedURL is the database URL without its password.
func redactedURL(conn string) string {
	if u, err := url.Parse(conn); err == nil && strings.Contains(conn, "://") {
		return u.Redacted()
	}
	return passwordParam.ReplaceAllString(conn, "password=xxxxx")
}

var urlPassword = regexp.MustCompile(`(://[^:/@\s]*:)[^@\s]*@`)

// scrubbed removes password, and anything shaped like a password in a
// connection string, from msg.
func scrubbed(msg, password string) string {
	if password != "" {
		msg = strings.ReplaceAll(msg, password, "xxxxx")
	}
	msg = urlPassword.ReplaceAllString(msg, "${1}xxxxx@")
	return passwordParam.ReplaceAllString(msg, "password=xxxxx")
}
