package redis_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/grpctest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// TestFailover kills a cluster primary under load while its replica lags
// (DEBUG SLEEP holds the replica for a second, so the primary's last writes
// have not reached it), and lets the replica take over. A CreateCharge like
// the example's runs behind the interceptor on the Redis store, with the
// charges in memory; every key is retried until it gets a reply, and then
// sent once more after the failover. Counted: keys charged twice, keys
// whose acknowledged reply did not replay, and keys refused because the
// store failed closed.
//
// Waiting for one replica (WithReplicas(1)): none of any. Without it, the
// primary acknowledges what the replica never gets: the store sees its write
// counters gone back on the lagging replica and fails closed (refusing every
// key from then on), and still no key is charged twice.
func TestFailover(t *testing.T) {
	cluster := redistest.StartCluster(t, time.Second)
	for _, tc := range []struct {
		name     string
		replicas int
	}{{"wait", 1}, {"nowait", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.replicas == 0 && !*failoverNoWait {
				t.Skip("counts the loss without waiting for replicas: run with -failover-nowait")
			}
			r := failover(t, cluster, tc.replicas)
			t.Logf("replicas waited for %d: %d keys acknowledged, %d calls, %d charged twice so far, %d acknowledged replies lost (replayed differently, or in progress again), %d refused by the store failed closed; writes the lagging replica never got: %d",
				tc.replicas, r.keys, r.calls, r.doubles, r.lost, r.refused, r.unreplicated)
			if r.doubles > 0 {
				t.Errorf("%d keys charged twice; want 0", r.doubles)
			}
			switch {
			case tc.replicas > 0 && (r.lost > 0 || r.failedClosed):
				t.Errorf("waiting for a replica: %d acknowledged replies lost, store failed closed %v; want 0 and false", r.lost, r.failedClosed)
			case tc.replicas == 0 && r.unreplicated > 0 && !r.failedClosed:
				t.Errorf("without waiting: the replica that took over missed %d writes and the store served on; want it failed closed", r.unreplicated)
			}
			if r.keys < 100 {
				t.Errorf("only %d keys got a reply: the load did not run", r.keys)
			}
		})
	}
}

var failoverNoWait = flag.Bool("failover-nowait", false, "TestFailover: also count what a failover loses without waiting for replicas (about 10s)")

type failoverResult struct {
	keys, calls, doubles, lost, refused, unreplicated int
	failedClosed                                      bool
}

func failover(t *testing.T, cluster *redistest.Cluster, replicas int) failoverResult {
	ctx := context.Background()
	client := cluster.Client(t)
	st, err := redis.New(ctx, client, redis.WithPrefix(prefix()), redis.WithReplicas(replicas), redis.WithTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ledger := &chargeLedger{charges: map[string]int{}}
	eng := grpctest.Must(engine.New(st,
		engine.WithTenant(func(context.Context) (string, error) { return "acme", nil }),
		engine.WithLogger(slog.New(slog.DiscardHandler))))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, ledger)
	lis := grpctest.Serve(t, srv)
	conn := grpctest.Dial(t, lis, grpc.WithDefaultServiceConfig(retryPolicy))
	payments := paymentsv1.NewPaymentServiceClient(conn)

	// failedClosed reports whether the store has seen its data lost: then
	// it refuses every call for good.
	failedClosed := func() bool {
		_, _, err := st.Find(ctx, store.ScopeKey("acme", "/probe", "probe"))
		return errors.Is(err, store.ErrDataLost)
	}
	// call sends key's request until it gets a reply, for up to 20s, or
	// until the store has failed closed.
	var calls atomic.Int64
	call := func(key string) (*paymentsv1.Charge, error) {
		ctx := metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
		req := &paymentsv1.CreateChargeRequest{CustomerId: key, Amount: 100, Currency: "EUR"}
		var err error
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			calls.Add(1)
			var c *paymentsv1.Charge
			if c, err = payments.CreateCharge(ctx, req); err == nil {
				return c, nil
			}
			if failedClosed() {
				return nil, store.ErrDataLost
			}
		}
		return nil, err
	}

	var (
		mu      sync.Mutex
		replies = map[string]string{} // key -> charge id of its acknowledged reply
		stop    atomic.Bool
		wg      sync.WaitGroup
		n       atomic.Int64
	)
	for w := range 16 {
		wg.Go(func() {
			for !stop.Load() {
				key := fmt.Sprintf("failover-%d-%d", w, n.Add(1))
				c, err := call(key)
				if errors.Is(err, store.ErrDataLost) {
					return
				}
				if err != nil {
					t.Errorf("key never got a reply: %v", err)
					return
				}
				mu.Lock()
				replies[key] = c.GetId()
				mu.Unlock()
			}
		})
	}

	time.Sleep(time.Second)
	primary, replica := primaryWithReplica(t, cluster)
	// The replica is held still and cut off from its primary, which goes on
	// acknowledging writes for half a second that never reach the replica,
	// and dies. Then the replica, resumed, takes over.
	replica.Signal(syscall.SIGSTOP)
	pc := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: primary.Addr})
	if err := pc.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
		t.Fatalf("CLIENT KILL TYPE replica: %v", err)
	}
	pc.Close()
	time.Sleep(500 * time.Millisecond)
	before := dbsize(t, primary)
	primary.Kill()
	killed := time.Now()
	replica.Signal(syscall.SIGCONT)
	waitPrimary(t, replica)
	tookOver := time.Since(killed)
	unreplicated := before - dbsize(t, replica)
	// Back as a replica of the new primary, so that writes can wait for it.
	primary.Restart(t)
	waitReplica(t, replica)
	synced := time.Since(killed)
	time.Sleep(500 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	t.Logf("after the kill: the replica took over in %v, the restarted primary was its replica in %v, the load ended at %v",
		tookOver.Round(10*time.Millisecond), synced.Round(10*time.Millisecond), time.Since(killed).Round(10*time.Millisecond))

	r := failoverResult{keys: len(replies), unreplicated: max(unreplicated, 0), failedClosed: failedClosed()}
	// Each acknowledged key once more, without the retry policy: its reply
	// must replay. A key found in progress lost its reply too, and runs
	// again once its lease ends.
	once := paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis, grpc.WithDisableRetry()))
	keys := make(chan string)
	var lost, refused, doubles atomic.Int64
	for range 16 {
		wg.Go(func() {
			for key := range keys {
				ctx := metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
				req := &paymentsv1.CreateChargeRequest{CustomerId: key, Amount: 100, Currency: "EUR"}
				c, err := once.CreateCharge(ctx, req)
				for i := 0; status.Code(err) == codes.Unavailable && !r.failedClosed && i < 100; i++ {
					time.Sleep(100 * time.Millisecond)
					c, err = once.CreateCharge(ctx, req)
				}
				switch {
				case status.Code(err) == codes.Aborted || (err == nil && c.GetId() != replies[key]):
					lost.Add(1)
				case status.Code(err) == codes.Unavailable && r.failedClosed:
					refused.Add(1)
				case err != nil:
					t.Errorf("replay after the failover: %v", err)
				}
				if ledger.count(key) > 1 {
					doubles.Add(1)
				}
			}
		})
	}
	for key := range replies {
		keys <- key
	}
	close(keys)
	wg.Wait()
	r.lost, r.refused, r.doubles, r.calls = int(lost.Load()), int(refused.Load()), int(doubles.Load()), int(calls.Load())
	return r
}

// chargeLedger is CreateCharge as the example's service runs it, in memory:
// a charge for each run, counted by customer (here, the key), after a short
// delay so that calls overlap.
type chargeLedger struct {
	paymentsv1.UnimplementedPaymentServiceServer
	mu      sync.Mutex
	charges map[string]int
	n       int
}

func (l *chargeLedger) CreateCharge(_ context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	time.Sleep(20 * time.Millisecond)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n++
	l.charges[req.GetCustomerId()]++
	return &paymentsv1.Charge{Id: fmt.Sprintf("ch_%d", l.n), CustomerId: req.GetCustomerId(), Amount: req.GetAmount(), Currency: req.GetCurrency()}, nil
}

func (l *chargeLedger) count(customer string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.charges[customer]
}

// retryPolicy retries CreateCharge as the example's service config does.
const retryPolicy = `{"methodConfig": [{
  "name": [{"service": "example.payments.v1.PaymentService", "method": "CreateCharge"}],
  "timeout": "10s",
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}
}]}`

// waitReplica waits until the primary s has a replica in sync.
func waitReplica(t *testing.T, s *redistest.Server) {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: s.Addr})
	defer c.Close()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if info, err := c.Info(context.Background(), "replication").Result(); err == nil && strings.Contains(info, "state=online") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the restarted primary did not become a replica in sync within 15s")
		}
	}
}

// primaryWithReplica returns a primary of the cluster and its replica.
func primaryWithReplica(t *testing.T, cluster *redistest.Cluster) (primary, replica *redistest.Server) {
	t.Helper()
	for _, n := range cluster.Nodes {
		c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: n.Addr})
		info, err := c.Info(context.Background(), "replication").Result()
		c.Close()
		if err != nil || !strings.Contains(info, "role:master") || !strings.Contains(info, "state=online") {
			continue
		}
		for _, m := range cluster.Nodes {
			if strings.Contains(info, "port="+strings.TrimPrefix(m.Addr, "127.0.0.1:")+",") {
				return n, m
			}
		}
	}
	t.Fatal("no primary with a replica in the cluster")
	return nil, nil
}

// waitPrimary waits until s has taken over as a primary.
func waitPrimary(t *testing.T, s *redistest.Server) {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: s.Addr})
	defer c.Close()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if info, err := c.Info(context.Background(), "replication").Result(); err == nil && strings.Contains(info, "role:master") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the replica did not take over within 15s")
		}
	}
}

func dbsize(t *testing.T, s *redistest.Server) int {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: s.Addr})
	defer c.Close()
	n, err := c.DBSize(context.Background()).Result()
	if err != nil {
		t.Fatalf("DBSIZE: %v", err)
	}
	return int(n)
}
