package seal_test

import (
	"testing"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/sealtest"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
	"github.com/idemkey/idemkey/store/postgres"
)

// Sealing on the memory store, whose only storage is the process's memory:
// its records are read back with Find.
func TestMemory(t *testing.T) {
	sealtest.Run(t, sealtest.Store{
		New: func(*testing.T) sealtest.Instance {
			st := memory.New()
			return sealtest.Instance{Store: st, Raw: func(t *testing.T, key store.Key) []byte {
				res, found, err := st.Find(t.Context(), key)
				if err != nil || !found {
					t.Fatalf("no record: %v", err)
				}
				return res.Outcome
			}}
		},
	})
}

// Sealing on PostgreSQL, two-phase and atomic: the outcome column holds no
// plaintext, and one copied by an UPDATE onto another key's row, or
// altered, does not open.
func TestPostgres(t *testing.T) {
	sealtest.Run(t, sealtest.Store{
		New: func(t *testing.T) sealtest.Instance {
			pool := pgtest.Pool(t, pgtest.Schema(t))
			if err := postgres.Migrate(t.Context(), pool); err != nil {
				t.Fatal(err)
			}
			st, err := postgres.New(pool)
			if err != nil {
				t.Fatal(err)
			}
			return sealtest.Instance{Store: st, Raw: func(t *testing.T, key store.Key) []byte {
				var outcome []byte
				if err := pool.QueryRow(t.Context(), `SELECT outcome FROM idempotency_keys WHERE key = $1`, key[:]).Scan(&outcome); err != nil {
					t.Fatalf("select the outcome: %v", err)
				}
				return outcome
			}, Write: func(t *testing.T, key store.Key, outcome []byte) {
				tag, err := pool.Exec(t.Context(), `UPDATE idempotency_keys SET outcome = $2 WHERE key = $1 AND state = 'completed'`, key[:], outcome)
				if err != nil || tag.RowsAffected() != 1 {
					t.Fatalf("update the outcome: %v, %d rows", err, tag.RowsAffected())
				}
			}}
		},
		Atomic: true,
	})
}
