package idemhttp_test

import (
	"testing"

	"github.com/idemkey/idemkey/internal/adaptertest"
	"github.com/idemkey/idemkey/internal/adaptertest/httpadapter"
)

// TestAdapterCases runs the behaviour cases every entry point passes over a
// real net/http client and server (internal/adaptertest/httpadapter).
func TestAdapterCases(t *testing.T) {
	adaptertest.Run(t, httpadapter.Adapter(), adaptertest.Stores()...)
}

// The tenant of "Authorization: Bearer TENANT", as the suite's server reads it.
var (
	authenticate      = httpadapter.Authenticate
	tenantFromContext = httpadapter.TenantFromContext
)
