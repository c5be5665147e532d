// Package spannertest gives each test a database of its own on a Cloud
// Spanner emulator, so that tests run in parallel without seeing each
// other's rows.
//
// The emulator is SPANNER_EMULATOR_HOST (make test starts one:
// scripts/with-spanner). Without it a test skips, except in CI (CI=true),
// where it fails: CI must never pass by skipping. The tests never reach a
// real Spanner: without the variable they go nowhere.
package spannertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	database "cloud.google.com/go/spanner/admin/database/apiv1"
	"cloud.google.com/go/spanner/admin/database/apiv1/databasepb"
	instance "cloud.google.com/go/spanner/admin/instance/apiv1"
	"cloud.google.com/go/spanner/admin/instance/apiv1/instancepb"
	spannerapi "cloud.google.com/go/spanner/apiv1"
	"cloud.google.com/go/spanner/apiv1/spannerpb"
	"google.golang.org/api/iterator"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// Project and Instance are where the test databases live on the emulator.
const (
	Project  = "idemkey-test"
	Instance = "test"
)

// Host returns the emulator's address, or "" without one.
func Host() string { return os.Getenv("SPANNER_EMULATOR_HOST") }

var (
	instanceOnce sync.Once
	instanceErr  error
)

// need skips t, or fails it in CI, without an emulator.
func need(t testing.TB) {
	t.Helper()
	if Host() != "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("SPANNER_EMULATOR_HOST is unset: CI runs the Spanner tests on the emulator (scripts/with-spanner starts one)")
	}
	t.Skip("SPANNER_EMULATOR_HOST is unset: no Spanner emulator (scripts/with-spanner starts one)")
}

// Database creates an empty database for t on the emulator, dropped when t
// ends, and returns its name (projects/P/instances/I/databases/D) and an
// admin client for it, closed when t ends.
func Database(t testing.TB) (name string, admin *database.DatabaseAdminClient) {
	t.Helper()
	need(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	instanceOnce.Do(func() { instanceErr = createInstance(ctx) })
	if instanceErr != nil {
		t.Fatalf("spannertest: instance on the emulator at %s: %v", Host(), instanceErr)
	}
	admin, err := database.NewDatabaseAdminClient(ctx)
	if err != nil {
		t.Fatalf("spannertest: %v", err)
	}
	t.Cleanup(func() { admin.Close() })
	var b [8]byte
	rand.Read(b[:])
	id := "t" + hex.EncodeToString(b[:])
	op, err := admin.CreateDatabase(ctx, &databasepb.CreateDatabaseRequest{
		Parent:          "projects/" + Project + "/instances/" + Instance,
		CreateStatement: "CREATE DATABASE `" + id + "`",
	})
	if err == nil {
		_, err = op.Wait(ctx)
	}
	if err != nil {
		t.Fatalf("spannertest: create database: %v", err)
	}
	name = "projects/" + Project + "/instances/" + Instance + "/databases/" + id
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := admin.DropDatabase(ctx, &databasepb.DropDatabaseRequest{Database: name}); err != nil {
			t.Errorf("spannertest: drop database: %v", err)
		}
	})
	return name, admin
}

// Client returns a data client of database, closed when t ends.
func Client(t testing.TB, database string) *spanner.Client {
	t.Helper()
	client, err := spanner.NewClientWithConfig(t.Context(), database, spanner.ClientConfig{DisableNativeMetrics: true})
	if err != nil {
		t.Fatalf("spannertest: client: %v", err)
	}
	t.Cleanup(client.Close)
	return client
}

// EndTransactions ends the read-write transactions left open on
// database's sessions, as Spanner ends a dead client's (it aborts a
// transaction idle for ten seconds), and returns how many sessions it
// went through. The emulator never ends one: a process killed inside a
// read-write transaction leaves it open, and the emulator, which allows one
// read-write transaction at a time, aborts every other of the database
// until it ends (cloud-spanner-emulator issues 30 and 137). A transaction
// begun on a session ends the one open there, and is rolled back. Call it
// only while no live client of the database is inside a transaction it
// means to commit.
func EndTransactions(t testing.TB, database string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := spannerapi.NewClient(ctx, option.WithEndpoint(Host()), option.WithoutAuthentication(),
		option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())))
	if err != nil {
		t.Fatalf("spannertest: %v", err)
	}
	defer c.Close()
	readWrite := &spannerpb.TransactionOptions{Mode: &spannerpb.TransactionOptions_ReadWrite_{ReadWrite: &spannerpb.TransactionOptions_ReadWrite{}}}
	n := 0
	for sessions := c.ListSessions(ctx, &spannerpb.ListSessionsRequest{Database: database}); ; n++ {
		s, err := sessions.Next()
		if err == iterator.Done {
			return n
		}
		if err != nil {
			t.Fatalf("spannertest: list sessions: %v", err)
		}
		tx, err := c.BeginTransaction(ctx, &spannerpb.BeginTransactionRequest{Session: s.GetName(), Options: readWrite})
		if err != nil {
			t.Fatalf("spannertest: begin a transaction on session %s: %v", s.GetName(), err)
		}
		if err := c.Rollback(ctx, &spannerpb.RollbackRequest{Session: s.GetName(), TransactionId: tx.GetId()}); err != nil {
			t.Fatalf("spannertest: roll back on session %s: %v", s.GetName(), err)
		}
	}
}

// createInstance creates the tests' instance, unless it exists.
func createInstance(ctx context.Context) error {
	admin, err := instance.NewInstanceAdminClient(ctx)
	if err != nil {
		return err
	}
	defer admin.Close()
	op, err := admin.CreateInstance(ctx, &instancepb.CreateInstanceRequest{
		Parent:     "projects/" + Project,
		InstanceId: Instance,
		Instance: &instancepb.Instance{
			Config:      "projects/" + Project + "/instanceConfigs/emulator-config",
			DisplayName: "idemkey tests",
			NodeCount:   1,
		},
	})
	if status.Code(err) == codes.AlreadyExists {
		return nil
	}
	if err != nil {
		return err
	}
	if _, err = op.Wait(ctx); status.Code(err) == codes.AlreadyExists {
		return nil
	}
	return err
}
