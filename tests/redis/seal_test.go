package redis_test

import (
	"encoding/hex"
	"testing"

	"github.com/idemkey/idemkey/internal/sealtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/redis"
	"github.com/idemkey/idemkey/tests/redistest"
)

// Sealing on Redis: the outcome field (o) of a record's hash holds no
// plaintext (HGET), and one copied with HSET onto another key's record, or
// altered, does not open.
func TestSeal(t *testing.T) {
	client := redistest.Client(t)
	sealtest.Run(t, sealtest.Store{New: func(t *testing.T) sealtest.Instance {
		p := prefix()
		st, err := redis.New(t.Context(), client, redis.WithPrefix(p))
		if err != nil {
			t.Fatal(err)
		}
		name := func(key store.Key) string { return p + ":{" + hex.EncodeToString(key[:]) + "}" }
		return sealtest.Instance{Store: st, Raw: func(t *testing.T, key store.Key) []byte {
			outcome, err := client.HGet(t.Context(), name(key), "o").Bytes()
			if err != nil {
				t.Fatalf("HGET the outcome: %v", err)
			}
			return outcome
		}, Write: func(t *testing.T, key store.Key, outcome []byte) {
			if n, err := client.HSet(t.Context(), name(key), "o", outcome).Result(); err != nil || n != 0 {
				t.Fatalf("HSET the outcome: %v (%d new fields, want an existing one)", err, n)
			}
		}}
	}})
}
