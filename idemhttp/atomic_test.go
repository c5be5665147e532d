package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store/postgres"
)

// TestAtomicMode checks on PostgreSQL that the handler's writes through
// r.Context()'s transaction commit with a recorded 201, and are undone under
// a recorded 404, whose record commits all the same.
func TestAtomicMode(t *testing.T) {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(t.Context(), `CREATE TABLE charges (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.Middleware(newEngine(t, st, engine.WithTenant(tenantFromContext), engine.WithLogger(nil)), idemhttp.WithAtomic())
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges/{id}", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		tx, ok := postgres.TxFromContext(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		id := r.PathValue("id")
		if _, err := tx.Exec(r.Context(), `INSERT INTO charges (id) VALUES ($1)`, id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if strings.HasPrefix(id, "declined") {
			http.Error(w, "declined "+id, http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, id)
	})))
	srv := httptest.NewServer(authenticate(mux))
	t.Cleanup(srv.Close)
	s := &server{t: t, url: srv.URL}

	exists := func(id string) bool {
		var n int
		if err := pool.QueryRow(context.WithoutCancel(t.Context()), `SELECT count(*) FROM charges WHERE id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	for _, tc := range []struct {
		id     string
		status int
		kept   bool
	}{{"ch_1", http.StatusCreated, true}, {"declined_1", http.StatusNotFound, false}} {
		before := runs
		first, firstBody := s.call("POST", "/v1/charges/"+tc.id, `"k-`+tc.id+`"`, "{}")
		replay, replayBody := s.call("POST", "/v1/charges/"+tc.id, `"k-`+tc.id+`"`, "{}")
		if first.StatusCode != tc.status || replay.StatusCode != tc.status || string(firstBody) != string(replayBody) ||
			replay.Header.Get(idemkey.ReplayedHeader) != "true" || runs-before != 1 {
			t.Fatalf("%s: first %d %q, replay %d %q %v after %d runs", tc.id, first.StatusCode, firstBody,
				replay.StatusCode, replayBody, replay.Header, runs-before)
		}
		if got := exists(tc.id); got != tc.kept {
			t.Fatalf("%s: the handler's write is there: %v, want %v", tc.id, got, tc.kept)
		}
	}
}
