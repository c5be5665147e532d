package adaptertest

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
)

// Stores are the stores every adapter runs the cases on: memory,
// PostgreSQL in both modes, and PostgreSQL sharded over three databases
// (store/pgshard) in both modes, each case in a schema of its own on each
// database (internal/pgtest).
func Stores() []Store {
	return []Store{
		{Name: "memory", New: func(*testing.T) store.Store { return memory.New() }, Down: func(*testing.T) store.Store { return down{} }},
		{Name: "postgres", New: newPostgres, Down: downPostgres, Atomic: true},
		{Name: "pgshard", New: newSharded, Down: downSharded, Atomic: true},
	}
}

// newSharded is a pgshard store over three databases: the suite's tenants
// spread over them by the hash.
func newSharded(t *testing.T) store.Store {
	pools := pgtest.ShardPools(t)
	shards := make([]*postgres.Store, len(pools))
	for i, pool := range pools {
		if err := postgres.Migrate(t.Context(), pool); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
		st, err := postgres.New(pool)
		if err != nil {
			t.Fatal(err)
		}
		shards[i] = st
	}
	st, err := pgshard.New(shards)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// downSharded is a pgshard store whose shards' server does not answer.
func downSharded(t *testing.T) store.Store {
	shards := make([]*postgres.Store, pgtest.Shards)
	for i := range shards {
		shards[i] = downPostgres(t).(*postgres.Store)
	}
	st, err := pgshard.New(shards)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func newPostgres(t *testing.T) store.Store {
	pool := pgtest.Pool(t, pgtest.Schema(t))
	if err := postgres.Migrate(t.Context(), pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	st, err := postgres.New(pool)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// downPostgres is a PostgreSQL store whose server does not answer: nothing
// listens on port 1.
func downPostgres(t *testing.T) store.Store {
	pool, err := pgxpool.New(t.Context(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st, err := postgres.New(pool, postgres.WithoutSchemaCheck()) // as if it went down after the start
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// down is a store whose every operation fails, for the memory store, which
// has no server to lose.
type down struct{}

func (down) Reserve(context.Context, store.Reservation) (store.Entry, error) {
	return store.Entry{}, ErrDown
}
func (down) Complete(context.Context, store.Key, store.Token, []byte) error { return ErrDown }
func (down) Release(context.Context, store.Key, store.Token) error          { return ErrDown }
func (down) Sweep(context.Context, int) (int, error)                        { return 0, ErrDown }
