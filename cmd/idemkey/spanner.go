package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/postgres"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
)

// spannerDB is a store on Cloud Spanner (store/spanner): its tables through
// the store's admin API, its schema through the database admin client.
type spannerDB struct {
	client *spanner.Client
	admin  *database.DatabaseAdminClient
	store  *idemspanner.Store
	name   string // projects/P/instances/I/databases/D
	table  string
}

var spannerName = regexp.MustCompile(`^projects/[^/]+/instances/[^/]+/databases/[^/]+$`)

// openSpanner makes the clients of the -spanner database, which connect
// when first used (to SPANNER_EMULATOR_HOST if it is set).
func (c *common) openSpanner(ctx context.Context) (*env, error) {
	if !spannerName.MatchString(c.spanner) {
		return nil, usageError("-spanner wants a database's name, projects/P/instances/I/databases/D")
	}
	client, err := spanner.NewClientWithConfig(ctx, c.spanner, spanner.ClientConfig{DisableNativeMetrics: true})
	if err != nil {
		return nil, err
	}
	// New checks the table name exactly as the store will; it makes no call.
	st, err := idemspanner.New(client, idemspanner.WithTable(c.table), idemspanner.WithTimeout(c.timeout))
	if err != nil {
		client.Close()
		return nil, usageError("-table: %s", strings.TrimPrefix(err.Error(), "idemkey spanner: "))
	}
	admin, err := database.NewDatabaseAdminClient(ctx)
	if err != nil {
		client.Close()
		return nil, err
	}
	return &env{db: spannerDB{client: client, admin: admin, store: st, name: c.spanner, table: c.table}, table: c.table, spanner: c.spanner}, nil
}

func (d spannerDB) records(ctx context.Context, from, to []byte, limit int) ([]postgres.Record, error) {
	recs, err := d.store.Records(ctx, from, to, limit)
	out := make([]postgres.Record, len(recs))
	for i, r := range recs {
		out[i] = postgres.Record(r) // the same fields
	}
	return out, err
}

func (d spannerDB) forget(ctx context.Context, key store.Key, force bool) (postgres.Record, bool, error) {
	rec, deleted, err := d.store.Forget(ctx, key, force)
	return postgres.Record(rec), deleted, err
}

func (d spannerDB) steps(ctx context.Context, key store.Key) ([]postgres.StepRecord, error) {
	steps, err := d.store.Steps(ctx, key)
	out := make([]postgres.StepRecord, len(steps))
	for i, st := range steps {
		out[i] = postgres.StepRecord{Name: st.Name, Done: st.Done, Result: st.Result, Fingerprint: st.Fingerprint, Expires: st.Expires, Now: st.Now}
	}
	return out, err
}

// stats fills the counts: Spanner tells no sizes to a query.
func (d spannerDB) stats(ctx context.Context, s *stats) error {
	st, err := d.store.Stats(ctx)
	if err != nil {
		return err
	}
	s.Completed, s.InProgress, s.InProgressLive, s.Expired = st.Completed, st.InProgress, st.InProgressLive, st.Expired
	s.oldestLive, s.now = st.OldestLive, st.Now
	return nil
}

// migrations is idemspanner.MigrationStatus, for output: Spanner keeps no
// time of a migration, nor one that a newer idemkey applied.
func (d spannerDB) migrations(ctx context.Context) ([]migration, error) {
	states, err := idemspanner.MigrationStatus(ctx, d.admin, d.name, idemspanner.WithTable(d.table))
	if err != nil {
		return nil, err
	}
	ms := make([]migration, len(states))
	for i, st := range states {
		ms[i] = migration{Version: st.Version, Name: st.Name, Applied: st.Applied, Known: true}
	}
	return ms, nil
}

func (d spannerDB) migrateUp(ctx context.Context) error {
	return idemspanner.Migrate(ctx, d.admin, d.name, idemspanner.WithTable(d.table))
}

func (d spannerDB) migrateDown(ctx context.Context, to int) ([]string, error) {
	return idemspanner.MigrateDown(ctx, d.admin, d.name, to, idemspanner.WithTable(d.table))
}

func (d spannerDB) missingTable(err error) bool {
	code := status.Code(err)
	return (code == codes.InvalidArgument || code == codes.NotFound) && strings.Contains(spannerDesc(err), "Table not found")
}

func (d spannerDB) close() {
	d.admin.Close()
	d.client.Close()
}

// spannerDesc is Spanner's description of err, without the client's
// wrapping.
func spannerDesc(err error) string {
	var st interface{ GRPCStatus() *status.Status }
	if errors.As(err, &st) {
		return st.GRPCStatus().Message()
	}
	return err.Error()
}

// describeSpanner says what went wrong with the Spanner database, or ok
// false if err is none of Spanner's.
func describeSpanner(err error, c *common) (msg string, ok bool) {
	code := status.Code(err)
	desc := spannerDesc(err)
	switch {
	case c.spanner == "" || code == codes.Unknown || code == codes.OK:
		return "", false
	case code == codes.DeadlineExceeded:
		return fmt.Sprintf("Spanner did not answer within -timeout %s", c.timeout), true
	case code == codes.Canceled:
		return "interrupted", true
	case code == codes.NotFound && (strings.Contains(desc, "Database not found") || strings.Contains(desc, "Instance not found")):
		return fmt.Sprintf("%s: create the database, then run idemkey migrate up -spanner %s", desc, c.spanner), true
	case code == codes.Unavailable:
		at := "Spanner"
		if host := os.Getenv("SPANNER_EMULATOR_HOST"); host != "" {
			at = "the Spanner emulator at " + host + " (SPANNER_EMULATOR_HOST)"
		}
		return fmt.Sprintf("cannot reach %s: %s", at, desc), true
	}
	return fmt.Sprintf("Spanner answered: %s (%s)", desc, code), true
}
