package main

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
)

// db is the store's tables as inspect, forget, stats and migrate read and
// change them, each call one of the store package's admin API: store/postgres
// (pgDB) or store/spanner (spannerDB). The records and steps are
// postgres.Record and postgres.StepRecord; store/spanner's have their
// fields (a Spanner step keeps no start time).
type db interface {
	records(ctx context.Context, from, to []byte, limit int) ([]postgres.Record, error)
	forget(ctx context.Context, key store.Key, force bool) (postgres.Record, bool, error)
	steps(ctx context.Context, key store.Key) ([]postgres.StepRecord, error)
	// stats fills the counts of s, and the sizes where the database tells them.
	stats(ctx context.Context, s *stats) error
	migrations(ctx context.Context) ([]migration, error)
	migrateUp(ctx context.Context) error
	migrateDown(ctx context.Context, to int) ([]string, error)
	// missingTable reports whether err says that a table (or its schema) is missing.
	missingTable(err error) bool
	close()
}

// pgDB is a store on PostgreSQL.
type pgDB struct {
	pool  *pgxpool.Pool
	store *postgres.Store
	table string
}

func (d pgDB) records(ctx context.Context, from, to []byte, limit int) ([]postgres.Record, error) {
	return d.store.Records(ctx, from, to, limit)
}

func (d pgDB) forget(ctx context.Context, key store.Key, force bool) (postgres.Record, bool, error) {
	return d.store.Forget(ctx, key, force)
}

func (d pgDB) steps(ctx context.Context, key store.Key) ([]postgres.StepRecord, error) {
	return d.store.Steps(ctx, key)
}

func (d pgDB) stats(ctx context.Context, s *stats) error {
	st, err := d.store.Stats(ctx)
	if err != nil {
		return err
	}
	s.Completed, s.InProgress, s.InProgressLive, s.Expired = st.Completed, st.InProgress, st.InProgressLive, st.Expired
	s.oldestLive, s.now = st.OldestLive, st.Now
	s.TotalBytes, s.TableBytes = &st.TotalBytes, &st.TableBytes
	for name, size := range st.Indexes {
		s.Indexes = append(s.Indexes, index{name, size})
	}
	slices.SortFunc(s.Indexes, func(a, b index) int { return strings.Compare(a.Name, b.Name) })
	return nil
}

// migrations is postgres.MigrationStatus, for output.
func (d pgDB) migrations(ctx context.Context) ([]migration, error) {
	states, err := postgres.MigrationStatus(ctx, d.pool, postgres.WithTable(d.table))
	if err != nil {
		return nil, err
	}
	ms := make([]migration, len(states))
	for i, st := range states {
		ms[i] = migration{Version: st.Version, Name: st.Name, Known: st.Known}
		if !st.Applied.IsZero() {
			ms[i].Applied, ms[i].AppliedAt = true, &st.Applied
		}
	}
	return ms, nil
}

func (d pgDB) migrateUp(ctx context.Context) error {
	return postgres.Migrate(ctx, d.pool, postgres.WithTable(d.table))
}

func (d pgDB) migrateDown(ctx context.Context, to int) ([]string, error) {
	return postgres.MigrateDown(ctx, d.pool, to, postgres.WithTable(d.table))
}

func (d pgDB) missingTable(err error) bool {
	var pgErr *pgconn.PgError
	return missingRelation(err) || errors.As(err, &pgErr) && pgErr.Code == "3F000" // no such table, or no such schema
}

func (d pgDB) close() { d.pool.Close() }
