package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Shards is how many databases ShardPools spreads a test over.
const Shards = 3

var (
	shardsOnce sync.Once
	shardsErr  error
)

// ShardURL is the connection string of shard database i: the test
// database's name with "_shard" and i after it, on the same server.
func ShardURL(i int) string {
	u := URL()
	if parsed, err := url.Parse(u); err == nil && strings.Contains(u, "://") {
		parsed.Path = "/" + shardName(i)
		return parsed.String()
	}
	return u + " dbname=" + shardName(i) // keyword=value form: the last one counts
}

// shardName is shard database i's name, after the test database's.
func shardName(i int) string {
	db := "postgres"
	if u, err := url.Parse(URL()); err == nil && strings.Contains(URL(), "://") {
		if name := strings.TrimPrefix(u.Path, "/"); name != "" {
			db = name
		}
	} else {
		for _, f := range strings.Fields(URL()) {
			if v, ok := strings.CutPrefix(f, "dbname="); ok {
				db = v
			}
		}
	}
	return fmt.Sprintf("%s_shard%d", db, i)
}

// ShardURLs returns the connection strings of Shards databases (created on
// the test server beside the test database the first time), each with a
// schema of its own for t as its search_path, dropped when t ends: a store
// sharded over real separate databases (store/pgshard), for code under
// test that takes URLs.
func ShardURLs(t testing.TB) []string {
	t.Helper()
	shardsOnce.Do(func() { shardsErr = createShards() })
	if shardsErr != nil {
		unreachable(t, shardsErr)
	}
	urls := make([]string, Shards)
	for i := range urls {
		var b [8]byte
		rand.Read(b[:])
		schema := "idemkey_test_" + hex.EncodeToString(b[:])
		u := ShardURL(i)
		if err := execOn(u, "CREATE SCHEMA "+schema); err != nil {
			unreachable(t, err)
		}
		t.Cleanup(func() {
			if err := execOn(u, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
				t.Errorf("drop test schema on shard: %v", err)
			}
		})
		urls[i] = withParams(u, "search_path="+schema)
	}
	return urls
}

// ShardPools returns a pool on each of ShardURLs, closed when t ends.
func ShardPools(t testing.TB) []*pgxpool.Pool {
	t.Helper()
	urls := ShardURLs(t)
	pools := make([]*pgxpool.Pool, len(urls))
	for i, u := range urls {
		pool, err := pgxpool.New(context.Background(), u)
		if err != nil {
			unreachable(t, err)
		}
		t.Cleanup(pool.Close)
		pools[i] = pool
	}
	return pools
}

// createShards creates the shard databases that do not exist yet. Another
// test process may create one at the same time: its duplicate is no error.
func createShards() error {
	for i := range Shards {
		name := shardName(i)
		for attempt := 0; ; attempt++ {
			err := exec("CREATE DATABASE " + pgx.Identifier{name}.Sanitize())
			var pgErr *pgconn.PgError
			switch {
			case err == nil, errors.As(err, &pgErr) && (pgErr.Code == "42P04" || pgErr.Code == "23505"):
				// created, or there already
			case errors.As(err, &pgErr) && pgErr.Code == "55006" && attempt < 20:
				// template1 in use by another process's CREATE DATABASE
				time.Sleep(100 * time.Millisecond)
				continue
			default:
				return err
			}
			break
		}
	}
	return nil
}

func execOn(conn, sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, conn)
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	_, err = c.Exec(ctx, sql)
	return err
}
