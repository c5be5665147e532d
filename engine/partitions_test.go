package engine

import (
	"strconv"
	"testing"

	"github.com/idemkey/idemkey/store"
)

// Every tenant gets its own partition, store.TenantPartition's, whichever
// tenants shared its slot before.
func TestPartitionsOf(t *testing.T) {
	ps := newPartitions()
	for round := range 3 {
		for i := range 500 {
			tenant := "tenant-" + strconv.Itoa(i)
			if got, want := ps.of(tenant), store.TenantPartition(tenant); got != want {
				t.Fatalf("round %d: the partition of %s is %x, want %x", round, tenant, got, want)
			}
		}
	}
	if ps.of("") != (store.Partition{}) {
		t.Fatal("no tenant has a partition")
	}
}
