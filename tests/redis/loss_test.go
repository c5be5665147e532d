package redis_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	"github.com/idemkey/idemkey/internal/logtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// heldLedger is chargeLedger with one customer, "held", whose charges wait
// until release is closed: a call that is running.
type heldLedger struct {
	*chargeLedger
	entered   chan struct{} // closed when the first held charge runs
	release   chan struct{}
	heldRuns  atomic.Int32
	enterOnce sync.Once
}

func newHeldLedger() *heldLedger {
	return &heldLedger{chargeLedger: &chargeLedger{charges: map[string]int{}}, entered: make(chan struct{}), release: make(chan struct{})}
}

func (l *heldLedger) CreateCharge(ctx context.Context, req *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	if req.GetCustomerId() == "held" {
		l.heldRuns.Add(1)
		l.enterOnce.Do(func() { close(l.entered) })
		<-l.release
	}
	return l.chargeLedger.CreateCharge(ctx, req)
}

// serveCharges serves svc behind the interceptor on st, for the tenant
// "acme", and returns a client that does not retry, and the interceptor's
// log.
func serveCharges(t *testing.T, st store.Store, svc paymentsv1.PaymentServiceServer) (paymentsv1.PaymentServiceClient, *logtest.Buffer) {
	logger, logs := logtest.New()
	eng := grpctest.Must(engine.New(st,
		engine.WithTenant(func(context.Context) (string, error) { return "acme", nil }),
		engine.WithLogger(logger)))
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Must(interceptor.UnaryServerInterceptor(eng))))
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	lis := grpctest.Serve(t, srv)
	return paymentsv1.NewPaymentServiceClient(grpctest.Dial(t, lis, grpc.WithDisableRetry())), logs
}

// charge sends a CreateCharge for the customer key, with key as its
// idempotency key.
func charge(payments paymentsv1.PaymentServiceClient, key string) (*paymentsv1.Charge, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, idemkey.KeyMetadata, key)
	return payments.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{CustomerId: key, Amount: 100, Currency: "EUR"})
}

// wantStoreUnavailable fails t unless err is the interceptor's "store
// unavailable".
func wantStoreUnavailable(t *testing.T, what string, err error) {
	t.Helper()
	if status.Code(err) != codes.Unavailable || idemkey.Reason(err) != idemkey.ReasonStoreUnavailable {
		t.Errorf("%s = %v; want Unavailable with reason %s", what, err, idemkey.ReasonStoreUnavailable)
	}
}

// wantDataLost fails t unless err is store.ErrDataLost with every one of
// words in its text.
func wantDataLost(t *testing.T, what string, err error, words ...string) {
	t.Helper()
	if !errors.Is(err, store.ErrDataLost) {
		t.Errorf("%s = %v; want store.ErrDataLost", what, err)
		return
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s = %v; want it to say %q", what, err, w)
		}
	}
}

// wantErrorLine fails t unless logs has a line at Error with every one of
// words, and none that holds one of the raw values.
func wantErrorLine(t *testing.T, name string, logs *logtest.Buffer, words []string, raw ...string) {
	t.Helper()
	found := false
	for line := range strings.Lines(logs.String()) {
		for _, r := range raw {
			if strings.Contains(line, r) {
				t.Errorf("the %s log holds the raw %q: %s", name, r, line)
			}
		}
		ok := strings.Contains(line, "level=ERROR")
		for _, w := range words {
			ok = ok && strings.Contains(line, w)
		}
		found = found || ok
	}
	if !found {
		t.Errorf("the %s log has no line at Error that says %q; logged:\n%s", name, words, logs)
	}
}

// record reserves and completes key on st, and returns its reservation.
func record(t *testing.T, st store.Store, key string) store.Reservation {
	t.Helper()
	r := store.Reservation{Key: store.ScopeKey("acme", "/m", key), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: time.Hour}
	res, err := st.Reserve(context.Background(), r)
	if err != nil || res.State != store.Acquired {
		t.Fatalf("Reserve of the new key %s = %v, %v; want acquired", key, res.State, err)
	}
	if err := st.Complete(context.Background(), r.Key, res.Token, []byte(key)); err != nil {
		t.Fatal(err)
	}
	return r
}

// After FLUSHDB, the recorded keys sent again run nothing: the store fails
// closed, the client gets "store unavailable", and both the interceptor and
// the store log the cause at Error. A duplicate of a call that was running
// during the flush does not run beside it, and the running call still gets
// its reply. A store of another process, idle through the flush, fails too
// once a process started after the flush has written a new marker.
func TestFlushFailsClosed(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	storeLogger, storeLogs := logtest.New()
	st, err := redis.New(ctx, client, redis.WithLogger(storeLogger))
	if err != nil {
		t.Fatal(err)
	}
	idle, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	looker, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	ledger := newHeldLedger()
	payments, logs := serveCharges(t, st, ledger)

	var keys []string
	for i := range 20 {
		key := "flush-key-" + strconv.Itoa(i)
		if _, err := charge(payments, key); err != nil {
			t.Fatalf("first charge of %s: %v", key, err)
		}
		keys = append(keys, key)
	}
	held := make(chan error, 1)
	go func() {
		_, err := charge(payments, "held")
		held <- err
	}()
	<-ledger.entered

	if err := client.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	for _, key := range keys {
		_, err := charge(payments, key)
		wantStoreUnavailable(t, "a recorded key sent after FLUSHDB", err)
		if n := ledger.count(key); n != 1 {
			t.Errorf("key %s charged %d times; want once", key, n)
		}
	}
	_, err = charge(payments, "held")
	wantStoreUnavailable(t, "a duplicate of a running call after FLUSHDB", err)
	close(ledger.release)
	if err := <-held; err != nil {
		t.Errorf("the call running during FLUSHDB = %v; want its own reply", err)
	}
	if n := ledger.heldRuns.Load(); n != 1 {
		t.Errorf("the held key ran %d times; want once", n)
	}

	r := store.Reservation{Key: store.ScopeKey("acme", "/m", "new"), Lease: time.Minute, Retention: time.Hour}
	_, err = st.Reserve(ctx, r)
	wantDataLost(t, "Reserve after FLUSHDB", err, "data was lost", "FLUSHDB", "restarts")
	_, _, err = st.Find(ctx, r.Key)
	wantDataLost(t, "Find after FLUSHDB", err, "data was lost")
	// A store that saw nothing of it finds out from its Lookup's script.
	_, _, _, err = looker.Lookup(ctx, store.ScopeKey("acme", "/m", keys[0]))
	wantDataLost(t, "Lookup after FLUSHDB, by a store that saw nothing of it", err, "data was lost")
	raw := append([]string{"acme", "held"}, keys...)
	wantErrorLine(t, "interceptor", logs, []string{"data was lost", "FLUSHDB"}, raw...)
	wantErrorLine(t, "store", storeLogs, []string{"data was lost", "FLUSHDB"}, raw...)

	// A process started after the flush writes a new epoch: it cannot know
	// of the loss. The store started before notices it all the same.
	if _, err := redis.New(ctx, client); err != nil {
		t.Fatal(err)
	}
	_, err = idle.Reserve(ctx, r)
	wantDataLost(t, "Reserve on a store started before the flush, after another started", err, "data was lost", "started after the loss")
}

// A server restarted without its data (no persistence) is a flush too.
func TestRestartWithoutDataFailsClosed(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	st, err := redis.New(context.Background(), client)
	if err != nil {
		t.Fatal(err)
	}
	r := record(t, st, "restart")
	srv.Kill()
	srv.Restart(t)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		res, err := st.Reserve(context.Background(), r)
		if errors.Is(err, store.ErrUnavailable) && time.Now().Before(deadline) {
			continue // the client reconnects
		}
		if err == nil {
			t.Fatalf("Reserve of a recorded key after the server restarted empty = %v; want store.ErrDataLost", res.State)
		}
		wantDataLost(t, "Reserve after a restart without the data", err, "data was lost")
		return
	}
}

// An expiry set on the store's write counter or on its marker (an
// operator's EXPIRE), which would end the store's sight of a loss once it
// fired, is refused before it does: a new key is answered "store
// unavailable" and runs nothing, the store's error wraps store.ErrDataLost
// and names the key and the fix (PERSIST), the logs say so at Error without
// a raw key, and recorded keys still replay; once the expiry is removed, new
// keys run again. A counter whose expiry fired is a loss, named so: the
// store fails for good, and a store made anew (a restarted process) serves.
func TestExpiryOnCounterOrMarkerFailsClosed(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	storeLogger, storeLogs := logtest.New()
	st, err := redis.New(ctx, client, redis.WithLogger(storeLogger))
	if err != nil {
		t.Fatal(err)
	}
	ledger := newHeldLedger()
	payments, logs := serveCharges(t, st, ledger)
	const recorded = "expiry-recorded"
	if _, err := charge(payments, recorded); err != nil {
		t.Fatal(err)
	}
	newKey := func(key string) store.Reservation {
		return store.Reservation{Key: store.ScopeKey("acme", "/m", key), Lease: time.Minute, Retention: time.Hour}
	}

	for i, name := range []string{"idemkey:writes", "idemkey:epoch"} {
		must(t, client.Expire(ctx, name, time.Hour).Err())
		key := "expiry-new-" + strconv.Itoa(i)
		_, err := charge(payments, key)
		wantStoreUnavailable(t, "a new key while "+name+" has an expiry", err)
		_, err = st.Reserve(ctx, newKey(key))
		wantDataLost(t, "Reserve of a new key while "+name+" has an expiry", err, name, "has an expiry", "PERSIST "+name)
		if _, err := charge(payments, recorded); err != nil {
			t.Errorf("a recorded key while %s has an expiry: %v; want its reply replayed", name, err)
		}
		wantErrorLine(t, "interceptor", logs, []string{"has an expiry", "PERSIST " + name}, "acme", key, recorded)
		must(t, client.Persist(ctx, name).Err())
		if _, err := charge(payments, key); err != nil {
			t.Errorf("a new key once the expiry of %s is removed: %v; want it run", name, err)
		}
		if n := ledger.count(key); n != 1 {
			t.Errorf("key %s charged %d times; want once, after the expiry was removed", key, n)
		}
	}
	if n := ledger.count(recorded); n != 1 {
		t.Errorf("the recorded key charged %d times; want once", n)
	}
	wantErrorLine(t, "store", storeLogs, []string{"has an expiry", "PERSIST idemkey:writes"}, "acme", recorded)

	// The counter's expiry fires before anyone removes it.
	must(t, client.PExpire(ctx, "idemkey:writes", time.Millisecond).Err())
	for deadline := time.Now().Add(10 * time.Second); client.Exists(ctx, "idemkey:writes").Val() == 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the counter did not expire")
		}
	}
	_, err = charge(payments, "expiry-after")
	wantStoreUnavailable(t, "a new key once the counter expired", err)
	if n := ledger.count("expiry-after"); n != 0 {
		t.Errorf("a new key once the counter expired charged %d times; want none", n)
	}
	_, err = st.Reserve(ctx, newKey("expiry-after"))
	wantDataLost(t, "Reserve once the counter expired", err, "data was lost", "idemkey:writes is gone", "expired", "restarts")
	_, err = st.Reserve(ctx, newKey("expiry-later"))
	wantDataLost(t, "Reserve after the store saw its counter gone", err, "data was lost")

	fresh, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := fresh.Reserve(ctx, newKey("expiry-after")); err != nil || res.State != store.Acquired {
		t.Errorf("Reserve of a new key on a store made after the loss = %v, %v; want acquired", res.State, err)
	}
}

// maxmemory-policy set to evict while the store runs fails it within the
// check interval, with an error and an Error log that name the policy and
// the fix; set back to noeviction, with no key evicted meanwhile, the store
// serves again.
func TestPolicyChangeFailsClosed(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	logger, logs := logtest.New()
	const interval = 100 * time.Millisecond
	st, err := redis.New(ctx, client, redis.WithCheckInterval(interval), redis.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	r := record(t, st, "policy")

	if err := client.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(interval + 50*time.Millisecond)
	_, err = st.Reserve(ctx, r)
	wantDataLost(t, "Reserve after maxmemory-policy allkeys-lru", err, "allkeys-lru", "CONFIG SET maxmemory-policy noeviction")
	err = st.Complete(ctx, r.Key, 1, nil)
	wantDataLost(t, "Complete after maxmemory-policy allkeys-lru", err, "allkeys-lru")
	wantErrorLine(t, "store", logs, []string{"allkeys-lru", "maxmemory-policy noeviction"}, "acme")

	if err := client.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(interval + 50*time.Millisecond)
	if res, err := st.Reserve(ctx, r); err != nil || res.State != store.Completed {
		t.Errorf("Reserve of the recorded key with noeviction again = %v, %v; want its record replayed", res.State, err)
	}
}

// Keys evicted while the store runs fail it for good, within the check
// interval, even once the policy is noeviction again: evicted records may
// have been among them, and their keys would run again.
func TestEvictionsFailClosed(t *testing.T) {
	srv := redistest.Start(t)
	client := srv.Client(t)
	ctx := context.Background()
	logger, logs := logtest.New()
	const interval = 100 * time.Millisecond
	st, err := redis.New(ctx, client, redis.WithCheckInterval(interval), redis.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	var recorded []store.Reservation
	for i := range 50 {
		recorded = append(recorded, record(t, st, "evict-"+strconv.Itoa(i)))
	}

	// Another writer fills the server past a maxmemory with a policy that
	// evicts; then the policy is set back, so that only the evictions are
	// left to notice.
	used, err := strconv.ParseInt(infoValue(t, client, "memory", "used_memory"), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	must(t, client.ConfigSet(ctx, "maxmemory", strconv.FormatInt(used+1<<20, 10)).Err())
	must(t, client.ConfigSet(ctx, "maxmemory-policy", "allkeys-lru").Err())
	value := strings.Repeat("x", 4096)
	for i := range 1000 {
		must(t, client.Set(ctx, fmt.Sprintf("other-app:%d", i), value, 0).Err())
	}
	if infoValue(t, client, "stats", "evicted_keys") == "0" {
		t.Fatal("the server evicted nothing: the test did not fill it")
	}
	must(t, client.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	must(t, client.ConfigSet(ctx, "maxmemory", "0").Err())

	time.Sleep(interval + 50*time.Millisecond)
	for _, r := range recorded {
		res, err := st.Reserve(ctx, r)
		if err == nil {
			t.Fatalf("Reserve of a recorded key after evictions = %v; want store.ErrDataLost", res.State)
		}
		wantDataLost(t, "Reserve after evictions", err, "evicted", "noeviction", "restart")
	}
	wantErrorLine(t, "store", logs, []string{"data was lost", "evicted"}, "acme")

	time.Sleep(interval + 50*time.Millisecond)
	_, err = st.Reserve(ctx, recorded[0])
	wantDataLost(t, "Reserve after evictions, later, with noeviction", err, "evicted")
}

// On a cluster, FLUSHALL on one primary fails the store at the first call
// that reaches one of its slots, and every call after it. A store started
// after the flush writes the lost slots' markers again: it runs their keys
// again, which no store can know better; a store started before it notices.
func TestClusterFlushFailsClosed(t *testing.T) {
	cluster := redistest.StartCluster(t, 5*time.Second)
	client := cluster.Client(t)
	ctx := context.Background()
	p := prefix()
	st, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	idle, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	var recorded []store.Reservation
	for i := range 60 {
		recorded = append(recorded, record(t, st, "cluster-"+strconv.Itoa(i)))
	}
	var flushed atomic.Bool // one primary only
	must(t, client.ForEachMaster(ctx, func(ctx context.Context, c *goredis.Client) error {
		if !flushed.CompareAndSwap(false, true) {
			return nil
		}
		return c.FlushAll(ctx).Err()
	}))

	failed := 0
	for i, r := range recorded {
		res, err := st.Reserve(ctx, r)
		switch {
		case err != nil:
			failed++
			wantDataLost(t, "Reserve after FLUSHALL on a primary", err, "data was lost", p+":epoch:{")
		case failed > 0:
			t.Errorf("Reserve of key %d = %v after an earlier one failed; want store.ErrDataLost from then on", i, res.State)
		case res.State != store.Completed:
			t.Errorf("Reserve of recorded key %d after FLUSHALL on a primary = %v; want store.ErrDataLost, or a replay from another primary", i, res.State)
		}
	}
	if failed == 0 {
		t.Fatal("no key failed after FLUSHALL on a primary: the lost slots went unnoticed")
	}

	logger, logs := logtest.New()
	later, err := redis.New(ctx, client, redis.WithPrefix(p), redis.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "markers were missing") {
		t.Errorf("New after a primary lost its data logged no warning of missing markers:\n%s", logs)
	}
	noticed := false
	for _, r := range recorded {
		if _, err := idle.Reserve(ctx, r); err != nil {
			wantDataLost(t, "Reserve on a store started before the flush", err, "started after the loss")
			noticed = true
			break
		}
	}
	if !noticed {
		t.Error("a store started before the flush replayed every key after another rewrote the markers")
	}
	ran := 0
	for _, r := range recorded {
		if res, err := later.Reserve(ctx, r); err == nil && res.State == store.Acquired {
			ran++
		}
	}
	if ran == 0 {
		t.Error("the store started after the flush acquired no recorded key of the lost slots; the package doc says it does")
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// infoValue returns field of INFO section.
func infoValue(t *testing.T, c *goredis.Client, section, field string) string {
	t.Helper()
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	t.Fatalf("INFO %s has no %s", section, field)
	return ""
}

// A server restarted from an older snapshot keeps the markers but loses the
// records written since: the store notices by its write counter, which went
// back below what it saw, and fails closed. The first call after the
// restore, on a key recorded after the snapshot, answers store.ErrDataLost
// rather than acquire it; so does every call after it, a replay of a key
// the snapshot holds included: once a loss is seen, the store fails every
// operation until the process restarts, as after a flush. Another store that
// wrote in between does not upset either before the restore, and one started
// after the later writes, idle since, notices as well. A store started
// after the restore cannot tell (the package doc says so): it finds the
// later keys new.
func TestRestoreFromOlderSnapshotFailsClosed(t *testing.T) {
	srv := redistest.Start(t) // save "": nothing is written to disk but by SAVE
	client := srv.Client(t)
	ctx := context.Background()
	logger, logs := logtest.New()
	st, err := redis.New(ctx, client, redis.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	other, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	var before, after []store.Reservation
	for i := range 5 {
		before = append(before, record(t, st, "before-"+strconv.Itoa(i)))
		record(t, other, "other-before-"+strconv.Itoa(i))
	}
	must(t, client.Save(ctx).Err())
	for i := range 5 {
		after = append(after, record(t, st, "after-"+strconv.Itoa(i)))
		record(t, other, "other-after-"+strconv.Itoa(i))
	}
	idle, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}

	// Killed, the server writes no snapshot of its own: it starts again from
	// the one SAVE wrote, before the later keys.
	srv.Kill()
	srv.Restart(t)

	var res store.Entry
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		res, err = st.Reserve(ctx, after[0])
		if !errors.Is(err, store.ErrUnavailable) || time.Now().After(deadline) {
			break // else the client reconnects
		}
	}
	if err == nil {
		t.Fatalf("Reserve of a key recorded after the snapshot, after the restore = %v; want store.ErrDataLost", res.State)
	}
	wantDataLost(t, "Reserve of a key recorded after the snapshot", err, "data was lost", "write counter", "older snapshot", "restarts")
	for _, r := range append(after[1:], before...) {
		res, err := st.Reserve(ctx, r)
		if err == nil {
			t.Fatalf("Reserve after the store saw the restore = %v; want store.ErrDataLost for every key", res.State)
		}
		wantDataLost(t, "Reserve after the store saw the restore", err, "data was lost")
	}
	_, _, err = st.Find(ctx, before[0].Key)
	wantDataLost(t, "Find after the store saw the restore", err, "data was lost")
	_, _, _, err = st.Lookup(ctx, after[0].Key)
	wantDataLost(t, "Lookup after the store saw the restore", err, "data was lost")
	wantErrorLine(t, "store", logs, []string{"data was lost", "write counter"}, "acme", "before-", "after-")

	_, err = idle.Reserve(ctx, store.Reservation{Key: store.ScopeKey("acme", "/m", "new"), Lease: time.Minute, Retention: time.Hour})
	wantDataLost(t, "Reserve of a new key on an idle store started before the restore", err, "write counter")

	later, err := redis.New(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	if _, found, err := later.Find(ctx, before[0].Key); err != nil || !found {
		t.Errorf("Find of a key the snapshot holds, on a store started after the restore = %v, %v; want found", found, err)
	}
	if _, found, err := later.Find(ctx, after[0].Key); err != nil || found {
		t.Errorf("Find of a key recorded after the snapshot, on a store started after the restore = %v, %v; want not found (the loss is invisible to it)", found, err)
	}
}

// On a cluster, each hash slot keeps its own write counter beside its
// records: one primary restarted from an older snapshot fails the store at
// the first call on a key that it recorded there after the snapshot, and
// every call after it.
func TestClusterRestoreFromOlderSnapshotFailsClosed(t *testing.T) {
	cluster := redistest.StartCluster(t, 5*time.Second) // restarted within it, the primary keeps its slots
	client := cluster.Client(t)
	ctx := context.Background()
	p := prefix()
	st, err := redis.New(ctx, client, redis.WithPrefix(p))
	if err != nil {
		t.Fatal(err)
	}
	var before, after []store.Reservation
	for i := range 30 {
		before = append(before, record(t, st, "cluster-before-"+strconv.Itoa(i)))
	}
	name := func(r store.Reservation) string { return p + ":{" + hex.EncodeToString(r.Key[:]) + "}" }
	primary, err := client.MasterForKey(ctx, name(before[0]))
	if err != nil {
		t.Fatal(err)
	}
	must(t, primary.Save(ctx).Err())
	for i := range 30 {
		after = append(after, record(t, st, "cluster-after-"+strconv.Itoa(i)))
	}
	var restored *redistest.Server
	for _, n := range cluster.Nodes {
		if n.Addr == primary.Options().Addr {
			restored = n
		}
	}
	restored.Kill()
	restored.Restart(t)

	// The first key recorded after the snapshot on the restored primary.
	var first store.Reservation
	for _, r := range after {
		if c, err := client.MasterForKey(ctx, name(r)); err == nil && c.Options().Addr == restored.Addr {
			first = r
			break
		}
	}
	if first.Key == (store.Key{}) {
		t.Fatal("no key recorded after the snapshot is on the restored primary")
	}
	var res store.Entry
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		res, err = st.Reserve(ctx, first)
		if !errors.Is(err, store.ErrUnavailable) || time.Now().After(deadline) {
			break // else the client reconnects
		}
	}
	if err == nil {
		t.Fatalf("Reserve of a key recorded after the snapshot on the restored primary = %v; want store.ErrDataLost", res.State)
	}
	wantDataLost(t, "Reserve of a key recorded after the snapshot on the restored primary", err, "write counter", p+":writes:{")
	for _, r := range append(after, before...) {
		if res, err := st.Reserve(ctx, r); err == nil {
			t.Fatalf("Reserve after the store saw a primary's restore = %v; want store.ErrDataLost for every key", res.State)
		}
	}
}
