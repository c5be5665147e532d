package spanner_test

import (
	"testing"

	"github.com/idemkey/idemkey/internal/leakcheck"
)

// TestMain fails the package's tests if they leave goroutines running: a
// client, transaction or store not closed or ended.
func TestMain(m *testing.M) { leakcheck.Main(m) }
