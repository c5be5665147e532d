package idemgateway_test

import (
	"testing"

	"github.com/idemkey/idemkey/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }
