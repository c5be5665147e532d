package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/spanner"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/tests/redistest"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// The stores for teams that outgrow one PostgreSQL, in both modes: Cloud
// Spanner (-spanner, a database of the test's own on the emulator) and
// three PostgreSQL shards (-shard-database-urls, a schema of the test's own
// on each). Each keeps the charges beside the keys, where ledgerOf reads
// them. Without the emulator or PostgreSQL their tests skip, and fail under
// CI=true (spannertest, pgtest).
var (
	spannerAtomic = stepStore{name: "spanner/atomic", args: func(t *testing.T) []string {
		db, _ := spannertest.Database(t)
		return []string{"-database-url=", "-spanner", db}
	}, kills: true, atomic: true}
	spannerTwoPhase = stepStore{name: "spanner/2-phase", args: func(t *testing.T) []string {
		db, _ := spannertest.Database(t)
		return []string{"-database-url=", "-spanner", db, "-atomic=false"}
	}, kills: true}
	shardsAtomic = stepStore{name: "shards/atomic", args: func(t *testing.T) []string {
		return []string{"-database-url=", "-shard-database-urls", strings.Join(pgtest.ShardURLs(t), ",")}
	}, kills: true, atomic: true, lockHeld: true}
	shardsTwoPhase = stepStore{name: "shards/2-phase", args: func(t *testing.T) []string {
		return []string{"-database-url=", "-shard-database-urls", strings.Join(pgtest.ShardURLs(t), ","), "-atomic=false"}
	}, kills: true}
)

// ledger is the database where a server keeps its charges and its keys'
// records: Spanner's, every shard's, or one PostgreSQL's.
type ledger struct {
	spanner  *spanner.Client
	database string // Spanner's
	pools    []*pgxpool.Pool
}

// ledgerOf opens the database that a server's flags args name (-spanner,
// -shard-database-urls or -database-url), or fails t if they name none.
func ledgerOf(t *testing.T, args []string) *ledger {
	t.Helper()
	l := openLedger(t, args)
	if l == nil {
		t.Fatalf("the server's flags %q name no database of charges", args)
	}
	return l
}

// openLedger is ledgerOf, which returns nil for flags that name no
// database (memory, Redis).
func openLedger(t *testing.T, args []string) *ledger {
	t.Helper()
	flags := map[string]string{}
	for i := 0; i < len(args); i++ {
		name, value, ok := strings.Cut(strings.TrimLeft(args[i], "-"), "=")
		if !ok && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			value, i = args[i+1], i+1
		}
		flags[name] = value
	}
	l := &ledger{}
	open := func(url string) {
		pool, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		l.pools = append(l.pools, pool)
	}
	switch {
	case flags["spanner"] != "":
		l.database = flags["spanner"]
		l.spanner = spannertest.Client(t, l.database)
	case flags["shard-database-urls"] != "":
		for _, url := range strings.Split(flags["shard-database-urls"], ",") {
			open(url)
		}
	case flags["database-url"] != "":
		open(flags["database-url"])
	default:
		return nil
	}
	return l
}

// charges counts the charges of every tenant.
func (l *ledger) charges(t *testing.T) int {
	t.Helper()
	n := 0
	if l.spanner != nil {
		c, _ := l.spannerCounts(t, spanner.Statement{SQL: `SELECT COUNT(*), 0 FROM charges`})
		n += int(c[0])
	}
	for _, pool := range l.pools {
		n += count(t, pool, "charges")
	}
	return n
}

// keyState counts the charges that carry the processor's charge id
// processorID and the completed records of acme's CreateCharge key, each
// database read at one instant: an atomic call's charge and its record
// commit together, so whenever they are read they are both there or both
// missing.
func (l *ledger) keyState(t *testing.T, key, processorID string) (charges, records int) {
	t.Helper()
	hash := store.ScopeKey("acme", createChargeOp, key)
	if l.spanner != nil {
		n, _ := l.spannerCounts(t, spanner.Statement{
			SQL: `SELECT (SELECT COUNT(*) FROM charges WHERE processor_charge_id = @charge),
				(SELECT COUNT(*) FROM idempotency_keys AS r WHERE r.key = @key AND r.outcome IS NOT NULL)`,
			Params: map[string]any{"charge": processorID, "key": hash[:]},
		})
		charges, records = int(n[0]), int(n[1])
	}
	for _, pool := range l.pools {
		var c, r int
		err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM charges WHERE processor_charge_id = $1),
			(SELECT count(*) FROM idempotency_keys WHERE key = $2 AND state = 'completed')`, processorID, hash[:]).Scan(&c, &r)
		if err != nil {
			t.Fatal(err)
		}
		charges, records = charges+c, records+r
	}
	return charges, records
}

// life returns how long the record of hash lives, from its creation to
// its expiry, as the database holds it; it fails t if there is none.
func (l *ledger) life(t *testing.T, hash store.Key) time.Duration {
	t.Helper()
	var lives []time.Duration
	if l.spanner != nil {
		n, found := l.spannerCounts(t, spanner.Statement{
			SQL:    `SELECT TIMESTAMP_DIFF(r.expires_at, r.created_at, MICROSECOND), 0 FROM idempotency_keys AS r WHERE r.key = @key`,
			Params: map[string]any{"key": hash[:]},
		})
		if found {
			lives = append(lives, time.Duration(n[0])*time.Microsecond)
		}
	}
	for _, pool := range l.pools {
		var life time.Duration
		err := pool.QueryRow(context.Background(), `SELECT expires_at - created_at FROM idempotency_keys WHERE key = $1`, hash[:]).Scan(&life)
		if err == nil {
			lives = append(lives, life)
		} else if !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
	}
	if len(lives) != 1 {
		t.Fatalf("%d records of %s, want 1", len(lives), hash)
	}
	return lives[0]
}

// spannerCounts runs stmt, whose row, if any, is two numbers, as a strong
// read; found is false without a row.
func (l *ledger) spannerCounts(t *testing.T, stmt spanner.Statement) (n [2]int64, found bool) {
	t.Helper()
	if err := l.spanner.Single().Query(context.Background(), stmt).Do(func(row *spanner.Row) error {
		found = true
		return row.Columns(&n[0], &n[1])
	}); err != nil {
		t.Fatal(err)
	}
	return n, found
}

// Server processes sharing their keys behave as one service, on every
// store that outlives them as on PostgreSQL: a duplicate sent to process B
// while A runs the first call (it has charged the processor) is Aborted
// (in progress), the retry on B gets A's reply, the key reused for another
// request is refused, the same key sent by another tenant runs a charge of
// its own, and both replies survive both processes being killed. So in
// PostgreSQL, Redis (one server or a cluster) and three PostgreSQL shards,
// and in Spanner, each database in both modes: the charges, counted in the
// ledger's database (PostgreSQL beside Redis), and the processor's are one
// per tenant.
func TestKeysBehaveAsOnPostgres(t *testing.T) {
	redis := func(name string, flags func(t *testing.T) []string) stepStore {
		return stepStore{name: name, args: func(t *testing.T) []string { return append(postgresTwoPhase.args(t), flags(t)...) }}
	}
	for _, st := range []stepStore{
		postgresTwoPhase, postgresAtomic,
		redis("redis-url", func(t *testing.T) []string { return []string{"-redis-url", "redis://" + redistest.Start(t).Addr} }),
		redis("redis-cluster", func(t *testing.T) []string {
			return []string{"-redis-cluster", strings.Join(redistest.StartCluster(t, 5*time.Second).Addrs(), ",")}
		}),
		spannerAtomic, spannerTwoPhase, shardsAtomic, shardsTwoPhase,
	} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			bin := servertest.Build(t)
			p := startProcessor(t)
			args := append(st.args(t), "-processor-url", p.url)
			// A's call outlasts the wait of B's duplicate (the engine's
			// default), three times over for a busy machine.
			a := servertest.Start(t, bin, append(args, "-handler-delay", (3*engine.DefaultInProgressWait).String())...)
			b := servertest.Start(t, bin, args...)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}

			first := make(chan *paymentsv1.Charge, 1)
			go func() {
				charge, _, err := create(a, key, req)
				if err != nil {
					t.Errorf("first call on A: %v", err)
				}
				first <- charge
			}()
			waitUntil(t, "A has charged the processor", func() bool { return p.charges(t) == 1 })
			ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer sk_test_acme", idemkey.KeyMetadata, key)
			if _, err := paymentsv1.NewPaymentServiceClient(b.Conn).CreateCharge(ctx, req); status.Code(err) != codes.Aborted || idemkey.Reason(err) != idemkey.ReasonInProgress {
				t.Fatalf("duplicate on B during A's call: %v, want Aborted %s", err, idemkey.ReasonInProgress)
			}
			want := <-first
			wantReplay(t, b, key, req, want, "B")
			other := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 999, Currency: "EUR"}
			if _, _, err := create(b, key, other); status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
				t.Errorf("the key reused for another request: %v, want InvalidArgument %s", err, idemkey.ReasonKeyReused)
			}
			globex, trailer, err := createAs(b, "sk_test_globex", key, req)
			if err != nil || idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) || globex.GetId() == want.GetId() {
				t.Fatalf("acme's key sent by globex: %v, %v (replayed %v); want a charge of globex's own, not %s",
					globex, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)), want.GetId())
			}
			for _, s := range []*servertest.Server{a, b} {
				if err := s.Kill(); err != nil {
					t.Fatal(err)
				}
			}
			c := servertest.Start(t, bin, args...)
			wantReplay(t, c, key, req, want, "a new process after both were killed")
			if again, trailer, err := createAs(c, "sk_test_globex", key, req); err != nil || !proto.Equal(again, globex) || !idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)) {
				t.Errorf("globex's retry on a new process: %v, %v (replayed %v); want globex's charge, replayed", again, err, idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)))
			}
			if n := ledgerOf(t, args).charges(t); n != 2 {
				t.Errorf("%d charges in the database, want 2: one per tenant", n)
			}
			if n := p.charges(t); n != 2 {
				t.Errorf("%d charges at the processor, want 2: one per tenant", n)
			}
		})
	}
}

// One key over every entry point of the built server on Spanner and on
// three PostgreSQL shards, in both modes: oneValueOneKey's calls (each
// key's first call, over one of gRPC, Connect JSON and proto, gRPC-Web and
// the gateway's POST /v1/charges, runs; every later call of it, over each
// of them, replays its charge), and the ledger in the store's database
// holds one charge per key.
func TestOneKeyOnEveryEntryPointOnEveryStore(t *testing.T) {
	bin := servertest.Build(t)
	for _, st := range []stepStore{spannerAtomic, spannerTwoPhase, shardsAtomic, shardsTwoPhase} {
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			args := st.args(t)
			s := startKeyServer(t, bin, args...)
			keys := oneValueOneKey(t, &entryPoints{grpc: s.grpc(), http: s.http})
			if n := ledgerOf(t, args).charges(t); n != keys {
				t.Errorf("%d charges in the database for %d keys, want one per key", n, keys)
			}
		})
	}
}
