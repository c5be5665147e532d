package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemkey/idemkey/example"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
)

// checkShards refuses -shard-database-urls beside another store, and what
// the sharded server does not do.
func (cfg config) checkShards() error {
	if len(cfg.shardURLs) == 0 {
		return nil
	}
	switch {
	case cfg.databaseURL != "" || cfg.redisURL != "" || cfg.redisCluster != "":
		return errors.New("-shard-database-urls is the store and the ledger: it takes neither -database-url (empty it: -database-url=) nor a Redis flag")
	case cfg.bare:
		return errors.New("-shard-database-urls shards the idempotency keys: -idempotency=false takes none")
	case cfg.outboxURL != "":
		return errors.New("-shard-database-urls takes no -outbox: each shard would need a relay of its own, which this server does not run")
	}
	for i, u := range cfg.shardURLs {
		if strings.TrimSpace(u) == "" {
			return fmt.Errorf("-shard-database-urls has an empty URL (shard %d)", i)
		}
	}
	return nil
}

// openShards opens and migrates each of -shard-database-urls, and returns
// the pgshard store over them, with its sweeper and listeners running until
// ctx ends, and the ledger whose charges live on each tenant's shard.
// closeAll, deferred, stops them and closes the pools.
func openShards(ctx context.Context, cfg config, logger *slog.Logger, meters metric.MeterProvider) (st *pgshard.Store, ledger example.Ledger, closeAll func(), err error) {
	var closers []func()
	closeAll = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	defer func() {
		if err != nil {
			closeAll()
		}
	}()
	shards := make([]*postgres.Store, len(cfg.shardURLs))
	ledgers := make([]*example.PostgresLedger, len(cfg.shardURLs))
	for i, url := range cfg.shardURLs {
		pool, err := example.OpenDatabase(ctx, url, true, logger)
		if err != nil {
			return nil, nil, nil, err
		}
		closers = append(closers, pool.Close)
		if shards[i], err = postgres.New(pool, postgres.WithLogger(logger)); err != nil {
			return nil, nil, nil, err
		}
		ledgers[i] = example.NewPostgresLedger(pool)
	}
	if st, err = pgshard.New(shards); err != nil {
		return nil, nil, nil, err
	}
	janitor := &store.Janitor{Store: st, Logger: logger, MeterProvider: meters}
	closers = append(closers, example.Background(ctx, janitor.Run, st.Listen))
	return st, example.NewShardedLedger(ledgers, st.ShardOf), closeAll, nil
}
