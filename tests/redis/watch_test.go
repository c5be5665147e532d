package redis_test

import (
	"context"
	"encoding/hex"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/idemkey/idemkey/internal/enginetest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// told waits for ch to be closed: a store that hears of a change by pub/sub
// has ample time.
func told(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: the watcher was never told", what)
	}
}

func notTold(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
		t.Fatalf("%s: the watcher was told of a change", what)
	default:
	}
}

// twoProcesses returns two stores on prefix p, each on a client of its own
// from client, as two processes would have.
func twoProcesses(t *testing.T, p string, client func() goredis.UniversalClient) (first, dup *redis.Store) {
	t.Helper()
	var stores [2]*redis.Store
	for i := range stores {
		st, err := redis.New(context.Background(), client(), redis.WithPrefix(p))
		if err != nil {
			t.Fatal(err)
		}
		stores[i] = st
	}
	return stores[0], stores[1]
}

// acquire reserves key on st, which no one holds, and returns its token.
func acquire(t *testing.T, st *redis.Store, key store.Key) store.Token {
	t.Helper()
	res, err := st.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour})
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve of a new key = %v, %v; want acquired", res.State, err)
	}
	return res.Token
}

// heldBy reserves key on st, where another store holds it.
func heldBy(t *testing.T, st *redis.Store, key store.Key) {
	t.Helper()
	res, err := st.Reserve(context.Background(), store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour})
	if err != nil || res.State != store.Held {
		t.Fatalf("Reserve of a key another store holds = %v, %v; want held", res.State, err)
	}
}

// A duplicate in one process hears of a Complete or Release made by
// another process's store on the same server, which the conformance suite,
// with one store, cannot show.
func TestWatchAcrossStores(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client func(t *testing.T) goredis.UniversalClient
	}{
		{"server", func(t *testing.T) goredis.UniversalClient { return redistest.Client(t) }},
		{"cluster", func(t *testing.T) goredis.UniversalClient { return redistest.SharedCluster(t).Client(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			first, dup := twoProcesses(t, prefix(), func() goredis.UniversalClient { return tc.client(t) })
			for _, end := range []string{"complete", "release"} {
				key := store.ScopeKey("tenant", "/m", end)
				token := acquire(t, first, key)
				heldBy(t, dup, key)
				changed, stop := dup.Watch(key)
				notTold(t, end+": a key held", changed)
				// Another key's Complete, which dup waits for too, tells
				// nothing of key once dup has heard it.
				other := store.ScopeKey("tenant", "/m", end+"-other")
				otherToken := acquire(t, first, other)
				heldBy(t, dup, other)
				otherChanged, stopOther := dup.Watch(other)
				if err := first.Complete(ctx, other, otherToken, []byte("other")); err != nil {
					t.Fatal(err)
				}
				told(t, end+": another key completed by another store", otherChanged)
				stopOther()
				notTold(t, end+": a key held, once another key completed", changed)
				var err error
				if end == "complete" {
					err = first.Complete(ctx, key, token, []byte("reply"))
				} else {
					err = first.Release(ctx, key, token)
				}
				if err != nil {
					t.Fatal(err)
				}
				told(t, end+" by another store", changed)
				stop()
				again, stop := dup.Watch(key)
				told(t, end+": a Watch after the change was heard", again)
				stop()
			}
		})
	}
}

// A duplicate whose store's subscription drops is told once the store has
// subscribed again, since the change may have come in the gap: it reads the
// key at once rather than wait on a message that may never come.
func TestWatchAfterTheSubscriptionDrops(t *testing.T) {
	for _, tc := range []struct {
		name string
		drop func(t *testing.T, srv *redistest.Server, client *goredis.Client)
	}{
		{"killed", func(t *testing.T, _ *redistest.Server, client *goredis.Client) {
			if err := client.Do(context.Background(), "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
				t.Fatal(err)
			}
		}},
		{"restarted", func(t *testing.T, srv *redistest.Server, _ *goredis.Client) {
			srv.Kill()
			srv.Restart(t)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			first, dup := twoProcesses(t, prefix(), func() goredis.UniversalClient { return srv.Client(t) })
			key := store.ScopeKey("tenant", "/m", "k")
			acquire(t, first, key)
			heldBy(t, dup, key)
			changed, stop := dup.Watch(key)
			defer stop()
			notTold(t, "a key held", changed)
			tc.drop(t, srv, srv.Client(t))
			told(t, "a key held, once the subscription is back", changed)
		})
	}
}

// BenchmarkDuplicateAnswered measures how long after a running call's
// Complete returns a duplicate held for it has its answer, on one Redis
// server, the two calls on two stores with clients of their own: told by
// the store (pub/sub), and polled (enginetest).
func BenchmarkDuplicateAnswered(b *testing.B) {
	p := prefix()
	var stores [2]*redis.Store
	for i := range stores {
		st, err := redis.New(context.Background(), redistest.Client(b), redis.WithPrefix(p))
		if err != nil {
			b.Fatal(err)
		}
		stores[i] = st
	}
	enginetest.DuplicateAnswered(b, stores[0], stores[1], false)
}

// Only a Complete or Release of a record that a Reserve found in progress
// sends a message: a key that no duplicate waited for costs no process a
// message.
func TestWatchMessagesOnlyForWaitedKeys(t *testing.T) {
	ctx := context.Background()
	client := redistest.Client(t)
	p := prefix()
	first, dup := twoProcesses(t, p, func() goredis.UniversalClient { return client })
	sub := client.Subscribe(ctx, p+":changed")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
		t.Fatal(err)
	}
	alone, waited := store.ScopeKey("tenant", "/m", "alone"), store.ScopeKey("tenant", "/m", "waited")
	aloneToken, waitedToken := acquire(t, first, alone), acquire(t, first, waited)
	heldBy(t, dup, waited)
	if err := first.Complete(ctx, alone, aloneToken, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	if err := first.Complete(ctx, waited, waitedToken, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	msgCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	msg, err := sub.ReceiveMessage(msgCtx) // messages arrive in the order sent
	if err != nil {
		t.Fatal(err)
	}
	if want := p + ":{" + hex.EncodeToString(waited[:]) + "}"; msg.Payload != want {
		t.Fatalf("first message %q, want the waited key's record %q alone", msg.Payload, want)
	}
}

// A user the server refuses the store's channel (Redis 7's ACL default for
// a new user grants no channel) still has a working store: New succeeds,
// a Complete that a duplicate waited for records, and Watch tells nothing,
// so the duplicate polls.
func TestWatchWithoutChannelPermission(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "nochannel", "on", "nopass", "~*", "+@all", "resetchannels").Err(); err != nil {
		t.Fatal(err)
	}
	client := func() goredis.UniversalClient {
		c := goredis.NewClient(&goredis.Options{MaintNotificationsConfig: redistest.NoMaintNotifications(), Addr: srv.Addr, Username: "nochannel", Password: "any"}) // nopass: any password; go-redis sends AUTH only with one
		t.Cleanup(func() { c.Close() })
		return c
	}
	if _, err := client().Subscribe(ctx, "probe").ReceiveTimeout(ctx, 5*time.Second); err == nil {
		t.Fatal("the user may subscribe: the test proves nothing")
	}
	first, dup := twoProcesses(t, "nochan", client)
	key := store.Key{7}
	token := acquire(t, first, key)
	heldBy(t, dup, key) // marks the record: a duplicate waits
	changed, stop := dup.Watch(key)
	defer stop()
	if changed != nil {
		t.Errorf("Watch without the channel: %v; want nil, which never fires", changed)
	}
	if err := first.Complete(ctx, key, token, []byte("reply")); err != nil {
		t.Fatalf("Complete of a record a duplicate waited for, with PUBLISH refused: %v", err)
	}
	res, err := dup.Reserve(ctx, store.Reservation{Key: key, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour})
	if err != nil || res.State != store.Completed || string(res.Outcome) != "reply" {
		t.Fatalf("the duplicate's poll: %v %q, %v; want the completed reply", res.State, res.Outcome, err)
	}
}

// Close ends the store's subscription (its connection on the server) and
// wakes its watchers; the store keeps working, and Watch then tells
// nothing, so duplicates poll. A second Close is harmless.
func TestCloseEndsTheSubscription(t *testing.T) {
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	subscribers := func() int {
		n, err := admin.Do(ctx, "PUBSUB", "NUMSUB", "closing:changed").Slice()
		if err != nil || len(n) != 2 {
			t.Fatalf("PUBSUB NUMSUB: %v, %v", n, err)
		}
		return int(n[1].(int64))
	}
	st, err := redis.New(ctx, srv.Client(t), redis.WithPrefix("closing"))
	if err != nil {
		t.Fatal(err)
	}
	if n := subscribers(); n != 1 {
		t.Fatalf("%d subscribers to the store's channel after New; want 1", n)
	}
	key := store.Key{9}
	token := acquire(t, st, key)
	changed, stop := st.Watch(key)
	defer stop()
	notTold(t, "a held key before Close", changed)
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	told(t, "Close", changed)
	for deadline := time.Now().Add(30 * time.Second); subscribers() != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d subscribers to the store's channel after Close; want 0", subscribers())
		}
	}
	if again, _ := st.Watch(key); again != nil {
		t.Errorf("Watch after Close: %v; want nil, which never fires", again)
	}
	if err := st.Complete(ctx, key, token, []byte("reply")); err != nil {
		t.Fatalf("Complete after Close: %v", err)
	}
	if err := st.Close(); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
}
