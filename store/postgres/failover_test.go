package postgres_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/logtest"
	"github.com/idemkey/idemkey/store/postgres"
)

// A URL that names a primary and its standby needs
// target_session_attrs=read-write (or primary), else the pool may connect to
// the standby, where every write fails: New warns of it, and only of it.
func TestMultiHostURLWithoutTargetSessionAttrsWarns(t *testing.T) {
	for _, tc := range []struct {
		url  string
		warn bool
	}{
		{"postgres://postgres@127.0.0.1:1,127.0.0.1:2/test", true},
		{"host=127.0.0.1,127.0.0.1 port=1,2 user=postgres dbname=test target_session_attrs=any", true},
		{"postgres://postgres@127.0.0.1:1,127.0.0.1:2/test?target_session_attrs=read-write", false},
		{"host=127.0.0.1,127.0.0.1 port=1,2 user=postgres dbname=test target_session_attrs=primary", false},
		// sslmode=prefer, the default, makes a second attempt at one host
		{"postgres://postgres@127.0.0.1:1/test", false},
	} {
		pool, err := pgxpool.New(context.Background(), tc.url) // connects lazily
		if err != nil {
			t.Fatal(err)
		}
		logger, logs := logtest.New()
		if _, err := postgres.New(pool, postgres.WithLogger(logger), postgres.WithoutSchemaCheck()); err != nil {
			t.Fatal(err)
		}
		pool.Close()
		if warned := strings.Contains(logs.String(), "target_session_attrs=read-write"); warned != tc.warn {
			t.Errorf("%s: warned %v, want %v; logged %q", tc.url, warned, tc.warn, logs.String())
		}
	}
}
