package redis_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/store/storetest"
	"github.com/idemkey/idemkey/tests/redistest"
)

func TestMain(m *testing.M) {
	goredis.SetLogger(quiet{}) // go-redis logs every failed dial of the failover test
	redistest.Main(m)
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// offsetClock is a Harness.Advance for WithClockOffset.
type offsetClock struct {
	mu     sync.Mutex
	offset time.Duration
}

func (c *offsetClock) get() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.offset
}

func (c *offsetClock) Advance(_ *testing.T, d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset += d
}

// prefix is a fresh key prefix, so that each store sees an empty server.
func prefix() string {
	var b [6]byte
	rand.Read(b[:])
	return "idemkey-test-" + hex.EncodeToString(b[:])
}

func harness(t *testing.T, client goredis.UniversalClient, opts ...redis.Option) storetest.Harness {
	clock := &offsetClock{}
	st, err := redis.New(context.Background(), client, append([]redis.Option{redis.WithPrefix(prefix()), redis.WithClockOffset(clock.get)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return storetest.Harness{Store: st, Advance: clock.Advance}
}

func TestConformance(t *testing.T) {
	client := redistest.Client(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness { return harness(t, client) })
}

func TestConformanceCluster(t *testing.T) {
	client := redistest.SharedCluster(t).Client(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness { return harness(t, client) })
}

// With a replica to wait for, the store behaves the same.
func TestConformanceWaitingForReplica(t *testing.T) {
	primary, _ := redistest.Replicated(t)
	client := primary.Client(t)
	storetest.Run(t, func(t *testing.T) storetest.Harness { return harness(t, client, redis.WithReplicas(1)) })
}

// New refuses a server that may evict records, and says what to change.
func TestRefusesEvictingServer(t *testing.T) {
	for _, policy := range []string{"allkeys-lru", "volatile-ttl"} {
		srv := redistest.Start(t, "--maxmemory-policy", policy)
		_, err := redis.New(context.Background(), srv.Client(t))
		if err == nil || !strings.Contains(err.Error(), "maxmemory-policy is "+policy) || !strings.Contains(err.Error(), "noeviction") {
			t.Errorf("New on a server with maxmemory-policy %s = %v; want a refusal that names the policy and noeviction", policy, err)
		}
	}
}

// The records are in the key's own hash slot, under the prefix, with
// nothing raw in them, beside the store's marker and write counter; and they
// expire natively, with no sweeper.
func TestRecordsExpireNatively(t *testing.T) {
	client := redistest.Client(t)
	p := prefix()
	st, err := redis.New(context.Background(), client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := store.ScopeKey("tenant-secret", "/m", "key-secret")
	res, err := st.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: 50 * time.Millisecond, Retention: 200 * time.Millisecond})
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve = %v, %v", res.State, err)
	}
	if err := st.Complete(ctx, key, res.Token, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	names, err := client.Keys(ctx, p+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	want := p + ":{" + hex.EncodeToString(key[:]) + "}"
	slices.Sort(names)
	if len(names) != 3 || names[0] != p+":epoch" || names[1] != p+":writes" || names[2] != want {
		t.Fatalf("keys written = %q, want only %q, the marker %q and the counter %q", names, want, p+":epoch", p+":writes")
	}
	fields, _ := client.HGetAll(ctx, want).Result()
	for _, v := range fields {
		if strings.Contains(v, "secret") {
			t.Errorf("the record holds a raw tenant or key: %q", v)
		}
	}
	time.Sleep(300 * time.Millisecond)
	if n, _ := client.Exists(ctx, want).Result(); n != 0 {
		t.Error("the record still exists after its retention: Redis did not expire it")
	}
}

// A token is never handed out twice for a key, even once its record has
// expired and gone.
func TestTokensNeverRepeat(t *testing.T) {
	st, err := redis.New(context.Background(), redistest.Client(t), redis.WithPrefix(prefix()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := store.ScopeKey("t", "/m", "k")
	seen := map[store.Token]bool{}
	for i := range 20 {
		res, err := st.Reserve(ctx, store.Reservation{Key: key, Lease: time.Millisecond, Retention: time.Millisecond})
		if err != nil || res.State != store.Acquired {
			t.Fatalf("Reserve %d = %v, %v; want acquired", i, res.State, err)
		}
		if seen[res.Token] {
			t.Fatalf("token %d handed out twice", res.Token)
		}
		seen[res.Token] = true
		switch i % 3 {
		case 0:
			_ = st.Release(ctx, key, res.Token)
		case 1:
			_ = st.Complete(ctx, key, res.Token, nil)
		}
		time.Sleep(2 * time.Millisecond) // past the record's life
	}
}

// An unreachable server is store.ErrUnavailable, with no address in the
// message; Complete keeps its own bound after the caller has gone.
func TestUnavailable(t *testing.T) {
	srv := redistest.Start(t)
	client := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: srv.Addr, MaxRetries: -1})
	defer client.Close()
	st, err := redis.New(context.Background(), client, redis.WithTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for name, err := range map[string]error{
		"Reserve": func() error {
			_, err := st.Reserve(context.Background(), store.Reservation{Key: store.ScopeKey("t", "/m", "k")})
			return err
		}(),
		"Complete": st.Complete(ctx, store.ScopeKey("t", "/m", "k"), 1, nil),
	} {
		if !errors.Is(err, store.ErrUnavailable) {
			t.Errorf("%s on a dead server = %v, want ErrUnavailable", name, err)
		}
		if err != nil && strings.Contains(err.Error(), "127.0.0.1") {
			t.Errorf("%s's error names the server's address: %v", name, err)
		}
		if errors.Is(err, context.Canceled) {
			t.Errorf("Complete with a cancelled context gave up at once (%v); it must ignore the caller's cancellation", err)
		}
	}
}

// Waiting for a replica that is not there fails the reservation as
// unavailable, within the store's timeout, and frees the key again.
func TestReplicaWaitWithoutReplica(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	p := prefix()
	waiting, err := redis.New(context.Background(), client, redis.WithPrefix(p), redis.WithReplicas(1), redis.WithTimeout(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	plain, err := redis.New(context.Background(), client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r := store.Reservation{Key: store.ScopeKey("t", "/m", "k"), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour}
	start := time.Now()
	if _, err := waiting.Reserve(ctx, r); !errors.Is(err, store.ErrUnavailable) || !strings.Contains(err.Error(), "0 of 1 replicas") {
		t.Fatalf("Reserve waiting for a missing replica = %v; want ErrUnavailable saying 0 of 1 replicas confirmed", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("Reserve took %v, past the store's timeout of 300ms", took)
	}
	res, err := plain.Reserve(ctx, r)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve after the failed one = %v, %v; want acquired (the key freed)", res.State, err)
	}
	if err := plain.Complete(ctx, r.Key, res.Token, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	// Replays write nothing, so they wait for nothing.
	if res, err := waiting.Reserve(ctx, r); err != nil || res.State != store.Completed {
		t.Errorf("replay with a missing replica = %v, %v; want completed", res.State, err)
	}
}
