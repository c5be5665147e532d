package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// seenPartitions records, for each store method the engine calls, the
// partition each call's context carried: what a store that routes by tenant
// (store/pgshard) reads.
type seenPartitions struct {
	mu   sync.Mutex
	seen map[string][]string // method -> the tenant of each call's partition, or "none"
	by   map[store.Partition]string
}

func newSeenPartitions(tenants ...string) *seenPartitions {
	s := &seenPartitions{seen: map[string][]string{}, by: map[store.Partition]string{}}
	for _, t := range tenants {
		s.by[store.TenantPartition(t)] = t
	}
	return s
}

func (s *seenPartitions) note(ctx context.Context, method string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	tenant := "none"
	if p, ok := store.PartitionFromContext(ctx); ok {
		if tenant, ok = s.by[p]; !ok {
			tenant = fmt.Sprintf("unknown %x", p)
		}
	}
	s.seen[method] = append(s.seen[method], tenant)
}

// want fails unless method was called, and every call carried tenant's partition.
func (s *seenPartitions) want(t *testing.T, tenant string, methods ...string) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range methods {
		got := s.seen[m]
		if len(got) == 0 || slices.ContainsFunc(got, func(g string) bool { return g != tenant }) {
			t.Errorf("%s: the calls' contexts carried the partitions of %q; want %q in each", m, got, tenant)
		}
	}
}

// partitionedMemory is a memory store that notes the partition of each call.
type partitionedMemory struct {
	*memory.Store
	seen *seenPartitions
}

func (s partitionedMemory) Reserve(ctx context.Context, r store.Reservation) (store.Entry, error) {
	s.seen.note(ctx, "Reserve")
	return s.Store.Reserve(ctx, r)
}

func (s partitionedMemory) Find(ctx context.Context, key store.Key) (store.Entry, bool, error) {
	s.seen.note(ctx, "Find")
	return s.Store.Find(ctx, key)
}

func (s partitionedMemory) Complete(ctx context.Context, key store.Key, token store.Token, outcome []byte) error {
	s.seen.note(ctx, "Complete")
	return s.Store.Complete(ctx, key, token, outcome)
}

func (s partitionedMemory) Release(ctx context.Context, key store.Key, token store.Token) error {
	s.seen.note(ctx, "Release")
	return s.Store.Release(ctx, key, token)
}

func (s partitionedMemory) Lookup(ctx context.Context, key store.Key) (store.Entry, []string, bool, error) {
	s.seen.note(ctx, "Lookup")
	return s.Store.Lookup(ctx, key)
}

func (s partitionedMemory) Renew(ctx context.Context, key store.Key, token store.Token, lease time.Duration) error {
	s.seen.note(ctx, "Renew")
	return s.Store.Renew(ctx, key, token, lease)
}

func (s partitionedMemory) StartStep(ctx context.Context, st store.StepStart) (store.StepEntry, error) {
	s.seen.note(ctx, "StartStep")
	return s.Store.StartStep(ctx, st)
}

func (s partitionedMemory) FinishStep(ctx context.Context, key store.Key, token store.Token, name string, result []byte) error {
	s.seen.note(ctx, "FinishStep")
	return s.Store.FinishStep(ctx, key, token, name, result)
}

func (s partitionedMemory) ForgetSteps(ctx context.Context, key store.Key, token store.Token, names ...string) error {
	s.seen.note(ctx, "ForgetSteps")
	return s.Store.ForgetSteps(ctx, key, token, names...)
}

// ReserveBatch notes each reservation's partition, and reserves each.
func (s partitionedMemory) ReserveBatch(ctx context.Context, rs []store.Reservation) ([]store.Entry, error) {
	res := make([]store.Entry, len(rs))
	for i, r := range rs {
		s.seen.note(store.ContextWithPartition(ctx, r.Partition), "ReserveBatch's reservations")
		var err error
		if res[i], err = s.Store.Reserve(ctx, r); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// partitionedFake is the fake atomic store, noting the partition of each
// call of Begin and of its transactions.
type partitionedFake struct {
	*fakeStore
	seen *seenPartitions
}

func (s partitionedFake) Begin(ctx context.Context, r store.Reservation) (store.Entry, store.Tx, error) {
	s.seen.note(ctx, "Begin")
	res, tx, err := s.fakeStore.Begin(ctx, r)
	if tx != nil {
		tx = partitionedTx{tx, s.seen}
	}
	return res, tx, err
}

type partitionedTx struct {
	store.Tx
	seen *seenPartitions
}

func (tx partitionedTx) Commit(ctx context.Context, outcome []byte, keepWrites bool) error {
	tx.seen.note(ctx, "Commit")
	return tx.Tx.Commit(ctx, outcome, keepWrites)
}

func (tx partitionedTx) Rollback(ctx context.Context) error {
	tx.seen.note(ctx, "Rollback")
	return tx.Tx.Rollback(ctx)
}

// ownTenantCall is a stepCall that tells its own tenant
// (OperationSpec.OwnTenant), and may be a retry.
type ownTenantCall struct {
	stepCall
	tenant  string
	retried bool
}

func (x *ownTenantCall) Tenant() string   { return x.tenant }
func (x *ownTenantCall) Attempt() Attempt { return Attempt{Retried: x.retried} }

// TestStorePartition: every store call the engine makes for a call, on
// every path (reserve and find, steps, a renewal, a record or a release
// detached from the caller, a lookup, an atomic commit and rollback, a
// two-phase batch's records), carries the call's tenant's partition in its
// context, which a store sharded by tenant routes by.
func TestStorePartition(t *testing.T) {
	t.Parallel()
	seen := newSeenPartitions("acme", "globex")
	tenantOf := func(ctx context.Context) (string, error) { return "acme", nil }
	const lease = 200 * time.Millisecond
	e, err := New(partitionedMemory{memory.New(), seen}, WithTenant(tenantOf), WithLease(lease))
	if err != nil {
		t.Fatal(err)
	}
	op, err := e.Operation(OperationSpec{Name: opName})
	if err != nil {
		t.Fatal(err)
	}
	// The caller hangs up as its handler returns: the writes after the
	// handler are detached from its cancellation, and still carry the
	// partition.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stepped := func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(context.Context) (string, error) { return "ch_1", nil }, nil)
		return err
	}
	x := &stepCall{key: "k1", request: "r", run: func(hctx context.Context) error {
		// Hold the key until its lease is renewed (the first renewal comes
		// at half the lease), however slow the machine.
		eventually(t, "a renewal", func() bool {
			seen.mu.Lock()
			defer seen.mu.Unlock()
			return len(seen.seen["Renew"]) > 0
		})
		return stepped(hctx)
	}}
	e.Serve(context.Background(), op, x)
	if x.answer.Verdict != Executed {
		t.Fatalf("first call: %v, want executed", x.answer.Verdict)
	}
	released := &stepCall{key: "k2", request: "r", run: func(ctx context.Context) error {
		if err := stepped(ctx); err != nil {
			return err
		}
		ForgetSteps(ctx)
		cancel()
		return errors.New("for now")
	}}
	e.Serve(ctx, op, released)
	notDone := &stepCall{key: "k3", request: "r", run: func(ctx context.Context) error {
		_, err := Step(ctx, "charge", func(context.Context) (string, error) { return "", NotDone(errors.New("declined")) }, nil)
		return err
	}}
	e.Serve(context.Background(), op, notDone)
	if _, err := e.Lookup(context.Background(), op, "k1", nil); err != nil {
		t.Fatalf("Lookup: %v", err)
	}
	own, err := e.Operation(OperationSpec{Name: opName, OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	retry := &ownTenantCall{stepCall: stepCall{key: "k1", request: "r"}, tenant: "acme", retried: true}
	e.Serve(context.Background(), own, retry)
	if retry.answer.Verdict != Replayed {
		t.Fatalf("retry: %v, want replayed", retry.answer.Verdict)
	}
	seen.want(t, "acme", "Reserve", "Find", "StartStep", "FinishStep", "Renew", "Complete", "Release", "ForgetSteps", "Lookup")

	// A two-phase batch of two tenants: each reservation has its tenant's
	// partition, and each call's record its own in its context.
	globex := newSeenPartitions("acme", "globex")
	eb, err := New(partitionedMemory{memory.New(), globex}, WithTenant(tenantOf))
	if err != nil {
		t.Fatal(err)
	}
	ownB, err := eb.Operation(OperationSpec{Name: opName, OwnTenant: true})
	if err != nil {
		t.Fatal(err)
	}
	ok := func(context.Context) error { return nil }
	eb.ServeBatch(context.Background(), ownB, []Exchange{
		&ownTenantCall{stepCall: stepCall{key: "b1", request: "r", run: ok}, tenant: "globex"},
		&ownTenantCall{stepCall: stepCall{key: "b2", request: "r", run: ok}, tenant: "globex"},
	})
	globex.want(t, "globex", "ReserveBatch's reservations", "Complete")

	// Atomic mode: Begin, and the transaction's Commit and Rollback.
	atomicSeen := newSeenPartitions("acme")
	ea, err := New(partitionedFake{newFakeStore(), atomicSeen}, WithTenant(tenantOf))
	if err != nil {
		t.Fatal(err)
	}
	opA, err := ea.Operation(OperationSpec{Name: opName, Atomic: true})
	if err != nil {
		t.Fatal(err)
	}
	ea.Serve(context.Background(), opA, &stepCall{key: "a1", request: "r", run: ok})
	ea.Serve(context.Background(), opA, &stepCall{key: "a2", request: "r", run: func(context.Context) error { return errors.New("for now") }})
	atomicSeen.want(t, "acme", "Begin", "Commit", "Rollback")
}
