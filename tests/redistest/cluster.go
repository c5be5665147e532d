package redistest

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
)

// Cluster is a Redis Cluster of three primaries, each with one replica.
type Cluster struct {
	Nodes []*Server // the first three are the primaries at creation
}

// Addrs returns every node's address, for goredis.ClusterOptions.Addrs.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr
	}
	return addrs
}

// Client returns a cluster client, closed when t ends.
func (c *Cluster) Client(t testing.TB) *goredis.ClusterClient {
	cc := goredis.NewClusterClient(&goredis.ClusterOptions{MaintNotificationsConfig: NoMaintNotifications(), Addrs: c.Addrs()})
	t.Cleanup(func() { cc.Close() })
	return cc
}

// SharedCluster returns the cluster of this test binary, started on first use
// with a node timeout of 5s, and stopped by Main.
func SharedCluster(t testing.TB) *Cluster {
	t.Helper()
	sharedMu.Lock()
	defer sharedMu.Unlock()
	if sharedCluster == nil {
		sharedCluster = startCluster(t, 5*time.Second, func(s *Server) { sharedServers = append(sharedServers, s) })
	}
	return sharedCluster
}

// StartCluster starts a cluster of its own for t, stopped when t ends; a
// replica takes over a primary that has not answered for nodeTimeout.
func StartCluster(t testing.TB, nodeTimeout time.Duration) *Cluster {
	t.Helper()
	return startCluster(t, nodeTimeout, func(s *Server) { t.Cleanup(s.Stop) })
}

func startCluster(t testing.TB, nodeTimeout time.Duration, own func(*Server)) *Cluster {
	t.Helper()
	cli := binary(t, "redis-cli")
	c := &Cluster{}
	for range 6 {
		s := start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10),
			// A replica whose link broke during a failover test may still take over.
			"--cluster-replica-validity-factor", "0")
		own(s)
		c.Nodes = append(c.Nodes, s)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitHealthy(t)
	return c
}

// WaitHealthy waits until every running node reports cluster_state:ok and
// every slot is served by a primary with a replica in sync.
func (c *Cluster) WaitHealthy(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, 30*time.Second, "the cluster to be healthy", func() bool {
		primaries := 0
		for _, n := range c.Nodes {
			n.mu.Lock()
			running := n.cmd != nil
			n.mu.Unlock()
			if !running {
				continue
			}
			cl := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: NoMaintNotifications(), Addr: n.Addr, MaxRetries: -1})
			info, err := cl.ClusterInfo(ctx).Result()
			repl, err2 := cl.Info(ctx, "replication").Result()
			cl.Close()
			if err != nil || err2 != nil || !strings.Contains(info, "cluster_state:ok") {
				return false
			}
			if strings.Contains(repl, "role:master") {
				if !strings.Contains(repl, "connected_slaves:1") || !strings.Contains(repl, "state=online") {
					return false
				}
				primaries++
			} else if !strings.Contains(repl, "master_link_status:up") {
				return false
			}
		}
		return primaries == 3
	})
}
