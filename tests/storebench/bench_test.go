// Package storebench measures the stores for teams that outgrow one
// PostgreSQL against one PostgreSQL, interleaved in one run so that the
// machine's noise hits them alike: store/pgshard on three databases of the
// same server, and store/spanner on the Cloud Spanner emulator, whose
// figures say nothing of Spanner's own latency (the emulator keeps
// everything in memory, allows one read-write transaction at a time, and
// the store runs its transactions one at a time on it).
package storebench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/interceptor"
	"github.com/idemkey/idemkey/internal/benchtest"
	"github.com/idemkey/idemkey/internal/grpctest"
	"github.com/idemkey/idemkey/internal/pgtest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/pgshard"
	"github.com/idemkey/idemkey/store/postgres"
	idemspanner "github.com/idemkey/idemkey/store/spanner"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// outcome is about the size of a recorded CreateCharge reply.
var outcome = make([]byte, 120)

const method = "/example.payments.v1.PaymentService/CreateCharge"

// stores are the three stores measured, in the order of the ops: one
// PostgreSQL (the baseline), three shards on the same server, and the
// Spanner emulator; and the tenants the calls rotate over, one on each
// shard, so that the sharded store's calls go to all three.
type stores struct {
	names   []string
	all     []store.Store
	tenants []string
}

// newStores makes the three stores on a schema, three shard schemas and a
// Spanner database of b's own, each migrated and dropped when b ends.
func newStores(b *testing.B) stores {
	b.Helper()
	ctx := b.Context()
	pool := pgtest.Pool(b, pgtest.Schema(b))
	if err := postgres.Migrate(ctx, pool); err != nil {
		b.Fatal(err)
	}
	pg, err := postgres.New(pool)
	if err != nil {
		b.Fatal(err)
	}
	var shards []*postgres.Store
	for _, pool := range pgtest.ShardPools(b) {
		if err := postgres.Migrate(ctx, pool); err != nil {
			b.Fatal(err)
		}
		st, err := postgres.New(pool)
		if err != nil {
			b.Fatal(err)
		}
		shards = append(shards, st)
	}
	sharded, err := pgshard.New(shards)
	if err != nil {
		b.Fatal(err)
	}
	db, admin := spannertest.Database(b)
	if err := idemspanner.Migrate(ctx, admin, db); err != nil {
		b.Fatal(err)
	}
	sp, err := idemspanner.New(spannertest.Client(b, db))
	if err != nil {
		b.Fatal(err)
	}
	// One tenant on each shard, found by the store's own routing.
	tenants := make([]string, len(shards))
	for i, found := 0, 0; found < len(shards); i++ {
		t := "tenant-" + strconv.Itoa(i)
		if s := sharded.ShardOf(t); tenants[s] == "" {
			tenants[s] = t
			found++
		}
	}
	return stores{names: []string{"postgres", "pgshard", "spanner"}, all: []store.Store{pg, sharded, sp}, tenants: tenants}
}

// tenant is the i-th call's tenant: the calls rotate over the shards. A
// negative i is a call of the set-up's.
func (s stores) tenant(i int) string {
	n := len(s.tenants)
	return s.tenants[(i%n+n)%n]
}

// first is a first call on st: Reserve of a new key, then Complete, each
// with its tenant's partition, in the context as the engine puts it.
func first(ctx context.Context, st store.Store, tenant, key string) error {
	p := store.TenantPartition(tenant)
	ctx = store.ContextWithPartition(ctx, p)
	k := store.ScopeKey(tenant, method, key)
	res, err := st.Reserve(ctx, store.Reservation{Key: k, Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: 24 * time.Hour, Partition: p})
	if err != nil {
		return err
	}
	if res.State != store.Acquired {
		return fmt.Errorf("reserve of a new key: %v", res.State)
	}
	return st.Complete(ctx, k, res.Token, outcome)
}

// replay is a retry of a recorded call on st: one Reserve, which finds the
// record.
func replay(ctx context.Context, st store.Store, tenant, key string) error {
	p := store.TenantPartition(tenant)
	ctx = store.ContextWithPartition(ctx, p)
	res, err := st.Reserve(ctx, store.Reservation{Key: store.ScopeKey(tenant, method, key), Fingerprint: store.Fingerprint{1}, Lease: time.Minute, Retention: 24 * time.Hour, Partition: p})
	if err == nil && res.State != store.Completed {
		err = fmt.Errorf("reserve of a recorded key: %v", res.State)
	}
	return err
}

// BenchmarkScaleOutStore runs a first call (Reserve and Complete of a new key)
// and a replay (Reserve of a recorded key) on one PostgreSQL, on
// store/pgshard over three databases of the same server, and on
// store/spanner on the emulator, interleaved, the calls rotating over three
// tenants, one on each shard. It reports each one's time and its ratio to
// the same call on one PostgreSQL ("pgshard-first/postgres").
func BenchmarkScaleOutStore(b *testing.B) {
	s := newStores(b)
	ctx := b.Context()
	for _, st := range s.all { // the replays' records
		for _, t := range s.tenants {
			if err := first(ctx, st, t, "replayed"); err != nil {
				b.Fatal(err)
			}
		}
	}
	run := idemkey.NewKey() // new keys on every run of the benchmark
	var ops []benchtest.Op
	for k, st := range s.all {
		ops = append(ops, benchtest.Op{Name: s.names[k] + "-first", Run: func(i int) error {
			return first(ctx, st, s.tenant(i), run+"-"+strconv.Itoa(i))
		}})
	}
	for k, st := range s.all {
		ops = append(ops, benchtest.Op{Name: s.names[k] + "-replay", Run: func(i int) error {
			return replay(ctx, st, s.tenant(i), "replayed")
		}})
	}
	ns := benchtest.Interleave(b, ops...)
	reportRatios(b, ops, ns, len(s.all))
}

// reportRatios reports each op's time as a ratio to that of the same call
// on one PostgreSQL ("<store>-<call>/postgres"): ops come in groups of per,
// one op per store, PostgreSQL's first.
func reportRatios(b *testing.B, ops []benchtest.Op, ns []float64, per int) {
	b.Helper()
	for g := 0; g < len(ops); g += per {
		for k := g + 1; k < g+per; k++ {
			b.ReportMetric(ns[k]/ns[g], ops[k].Name+"/postgres")
		}
	}
}

// chargeService answers CreateCharge and does no work of its own.
type chargeService struct {
	paymentsv1.UnimplementedPaymentServiceServer
}

func (chargeService) CreateCharge(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
	return &paymentsv1.Charge{Id: "ch_1"}, nil
}

// tenantMetadata carries the call's tenant, which the engine reads as an
// authenticated identity.
const tenantMetadata = "x-bench-tenant"

func tenantOf(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if t := md.Get(tenantMetadata); len(t) == 1 {
		return t[0], nil
	}
	return "", errors.New("no tenant")
}

// BenchmarkScaleOutGRPC runs CreateCharge over bufconn behind the gRPC
// interceptor with a handler that does nothing, on each of the three
// stores, in two-phase and atomic mode, as a first call (a new key) and a
// replay, all interleaved, the calls rotating over three tenants, one on
// each shard; every call checks that it was, or was not, a replay. It
// reports each one's time and its ratio to the same call on one PostgreSQL
// ("pgshard-atomic-first/postgres"): what the store changes of a call.
func BenchmarkScaleOutGRPC(b *testing.B) {
	s := newStores(b)
	serve := func(st store.Store, opts ...any) paymentsv1.PaymentServiceClient {
		srv := grpc.NewServer(grpc.UnaryInterceptor(grpctest.Interceptor(st, append(opts, engine.WithTenant(tenantOf), engine.WithLogger(nil))...)))
		paymentsv1.RegisterPaymentServiceServer(srv, chargeService{})
		return paymentsv1.NewPaymentServiceClient(grpctest.Dial(b, grpctest.Serve(b, srv)))
	}
	run := idemkey.NewKey()
	// call calls CreateCharge on client with the i-th call's tenant and key
	// (a new key each, "<run>-<op>-<i>", or the recorded key "replayed" if
	// op is ""), and fails unless the reply is a replay exactly when it
	// should be.
	call := func(client paymentsv1.PaymentServiceClient, op string, wantReplay bool) func(int) error {
		return func(i int) error {
			key := "replayed"
			if op != "" {
				key = run + "-" + op + "-" + strconv.Itoa(i)
			}
			var trailer metadata.MD
			ctx := metadata.AppendToOutgoingContext(b.Context(), idemkey.KeyMetadata, key, tenantMetadata, s.tenant(i))
			if _, err := client.CreateCharge(ctx, &paymentsv1.CreateChargeRequest{Amount: 1}, grpc.Trailer(&trailer)); err != nil {
				return err
			}
			if replayed := idemkey.ParseReplayed(trailer.Get(idemkey.ReplayedMetadata)); replayed != wantReplay {
				return fmt.Errorf("%s: replayed %v", op, replayed)
			}
			return nil
		}
	}
	var ops []benchtest.Op
	for _, mode := range []string{"two-phase", "atomic"} {
		var clients []paymentsv1.PaymentServiceClient
		for _, st := range s.all {
			if mode == "atomic" {
				clients = append(clients, serve(st, interceptor.WithAtomic()))
			} else {
				clients = append(clients, serve(st))
				for i := range s.tenants { // the replays' records, one for each tenant
					if err := call(clients[len(clients)-1], "", false)(i); err != nil {
						b.Fatal(err)
					}
				}
			}
		}
		for _, kind := range []string{"first", "replay"} {
			for k, client := range clients {
				name := s.names[k] + "-" + mode + "-" + kind
				if kind == "first" {
					ops = append(ops, benchtest.Op{Name: name, Run: call(client, name, false)})
				} else {
					ops = append(ops, benchtest.Op{Name: name, Run: call(client, "", true)})
				}
			}
		}
	}
	for _, op := range ops { // connect and prepare every path, on every shard
		for i := range s.tenants {
			if err := op.Run(-1 - i); err != nil {
				b.Fatal(err)
			}
		}
	}
	ns := benchtest.Interleave(b, ops...)
	reportRatios(b, ops, ns, len(s.all))
}
