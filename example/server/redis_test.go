package main

import (
	"strings"
	"testing"

	"github.com/idemkey/idemkey/internal/servertest"
	"github.com/idemkey/idemkey/tests/redistest"
)

// A Redis server that may evict keys stops the server at start, with a
// message that says why.
func TestRedisEvictionRefused(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory-policy", "allkeys-lru")
	s, err := servertest.Launch(servertest.Build(t), "-redis-url", "redis://"+srv.Addr, "-database-url=")
	if err == nil {
		s.Kill()
		t.Fatal("the server started on a Redis whose maxmemory-policy is allkeys-lru")
	}
	if !strings.Contains(err.Error(), "noeviction") {
		t.Errorf("the server's failure does not name the policy it needs: %v", err)
	}
}
