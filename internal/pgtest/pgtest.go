// Package pgtest gives each test its own schema on a real PostgreSQL server,
// so that tests run in parallel without seeing each other's rows.
//
// The server is IDEMKEY_TEST_DATABASE_URL, else DATABASE_URL, else
// postgres://postgres@127.0.0.1:5432/test. Where none answers, a test skips,
// except in CI (CI=true), where it fails: CI must never pass by skipping. A
// server that answers with an error (no such database, say) fails the test.
// make test starts a throwaway server when none answers (scripts/with-postgres).
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultURL is the server tests use when no variable names one.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the connection string of the test server.
func URL() string {
	for _, name := range []string{"IDEMKEY_TEST_DATABASE_URL", "DATABASE_URL"} {
		if u := os.Getenv(name); u != "" {
			return u
		}
	}
	return DefaultURL
}

// Schema creates an empty schema for t, dropped with everything in it when t
// ends, and returns its name.
func Schema(t testing.TB) string {
	t.Helper()
	schema, err := CreateSchema()
	if err != nil {
		unreachable(t, err)
	}
	t.Cleanup(func() {
		if err := DropSchema(schema); err != nil {
			t.Errorf("drop test schema: %v", err)
		}
	})
	return schema
}

// CreateSchema creates an empty schema with a random name, for a caller that
// outlives one test; DropSchema drops it.
func CreateSchema() (string, error) {
	var b [8]byte
	rand.Read(b[:])
	schema := "idemkey_test_" + hex.EncodeToString(b[:])
	return schema, exec("CREATE SCHEMA " + schema)
}

// DropSchema drops a schema made by CreateSchema and everything in it.
func DropSchema(schema string) error {
	return exec("DROP SCHEMA " + schema + " CASCADE")
}

func exec(sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, URL())
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// SchemaURL returns the test server's connection string with schema as the
// search_path and the runtime parameters params ("name=value") added, for
// code under test that takes a URL rather than a pool.
func SchemaURL(schema string, params ...string) string {
	return withParams(URL(), append([]string{"search_path=" + schema}, params...)...)
}

// withParams is the connection string u with the runtime parameters params
// ("name=value") added.
func withParams(u string, params ...string) string {
	for _, p := range params {
		switch {
		case !strings.Contains(u, "://"): // keyword=value form
			u += " " + p
		case strings.Contains(u, "?"):
			u += "&" + p
		default:
			u += "?" + p
		}
	}
	return u
}

// Pool returns a pool on the test server whose sessions work in schema (their
// search_path), closed when t ends. configure, if given, adjusts the pool's
// configuration first.
func Pool(t testing.TB, schema string, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatalf("test database URL: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	for _, f := range configure {
		f(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		unreachable(t, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// unreachable skips or fails a test that could not use the server. A server
// that answers with an error (no such database, a refused login, too many
// clients) fails the test everywhere: only a server that does not answer at
// all is a reason to skip, and only outside CI.
func unreachable(t testing.TB, err error) {
	t.Helper()
	where := redacted(URL())
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr):
		t.Fatalf("PostgreSQL at %s refused the tests: %v", where, err)
	case os.Getenv("CI") == "true":
		t.Fatalf("no PostgreSQL server at %s (%v). CI needs one: run the tests with make test, which starts a throwaway server when none answers", where, err)
	default:
		t.Skipf("no PostgreSQL server at %s (%v); make test starts a throwaway one", where, err)
	}
}

var password = regexp.MustCompile(`password=\S*`)

// redacted hides the password of a URL or keyword/value connection string.
func redacted(conn string) string {
	if u, err := url.Parse(conn); err == nil && strings.Contains(conn, "://") {
		return u.Redacted()
	}
	return password.ReplaceAllString(conn, "password=xxxxx")
}
