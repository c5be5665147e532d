package engine

import (
	"hash/maphash"
	"sync/atomic"

	"github.com/idemkey/idemkey/store"
)

// partitions keeps the partitions of the tenants of recent calls, so that
// a call does not hash its tenant again (store.TenantPartition is a
// SHA-256): one tenant a slot, the slot by a hash of the tenant's name; a
// tenant that finds another in its slot hashes its own and takes the slot.
// Like the store, it keeps tenants in memory only.
type partitions struct {
	seed  maphash.Seed
	slots [64]atomic.Pointer[tenantPartition]
}

type tenantPartition struct {
	tenant string
	p      store.Partition
}

func newPartitions() *partitions { return &partitions{seed: maphash.MakeSeed()} }

// of returns store.TenantPartition(tenant).
func (ps *partitions) of(tenant string) store.Partition {
	if tenant == "" {
		return store.Partition{}
	}
	slot := &ps.slots[maphash.String(ps.seed, tenant)%uint64(len(ps.slots))]
	if tp := slot.Load(); tp != nil && tp.tenant == tenant {
		return tp.p
	}
	p := store.TenantPartition(tenant)
	slot.Store(&tenantPartition{tenant, p})
	return p
}
