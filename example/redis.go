package example

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/idemkey/idemkey/store"
	redisstore "github.com/idemkey/idemkey/store/redis"
)

// OpenRedis connects to one Redis server (url) or a Redis Cluster (cluster:
// comma-separated seed addresses) and returns the store on it.
func OpenRedis(ctx context.Context, url, cluster string, logger *slog.Logger) (store.Store, func(), error) {
	var client goredis.UniversalClient
	if cluster != "" {
		client = goredis.NewClusterClient(&goredis.ClusterOptions{MaintNotificationsConfig: noMaintNotifications(), Addrs: strings.Split(cluster, ",")})
	} else {
		opts, err := goredis.ParseURL(url)
		if err != nil {
			return nil, nil, fmt.Errorf("redis-url: %w", err)
		}
		opts.MaintNotificationsConfig = noMaintNotifications()
		client = goredis.NewClient(opts)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := redisstore.New(ctx, client, redisstore.WithLogger(logger))
	if err != nil {
		client.Close()
		return nil, nil, err
	}
	return st, func() { client.Close() }, nil
}

// noMaintNotifications turns off go-redis's maintenance notifications, which
// Redis 7 lacks: in their default "auto" mode, go-redis v9.23 races on the
// connections the store's replica wait takes while it falls back.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
