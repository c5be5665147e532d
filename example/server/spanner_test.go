package main

import (
	"testing"

	"cloud.google.com/go/spanner"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/tests/spannertest"
)

// The server on Spanner (-spanner, on the emulator), atomic and two-phase:
// a key's first call makes one charge row, its retry replays the charge,
// the key reused for another request is refused, and a new process on the
// same database replays the charge too.
func TestSpanner(t *testing.T) {
	bin := servertest.Build(t)
	for _, mode := range []string{"atomic", "two-phase"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			db, _ := spannertest.Database(t)
			args := []string{"-spanner", db, "-atomic=" + map[string]string{"atomic": "true", "two-phase": "false"}[mode]}
			s := servertest.Start(t, bin, args...)
			key := idemkey.NewKey()
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 100, Currency: "EUR"}
			first, _, err := create(s, key, req)
			if err != nil {
				t.Fatalf("first call: %v\n%s", err, s.Logs())
			}
			wantReplay(t, s, key, req, first, "the same process")
			other := &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: 999, Currency: "EUR"}
			if _, _, err := create(s, key, other); status.Code(err) != codes.InvalidArgument || idemkey.Reason(err) != idemkey.ReasonKeyReused {
				t.Errorf("the key reused for another request: %v, want InvalidArgument %s", err, idemkey.ReasonKeyReused)
			}
			if err := s.Kill(); err != nil {
				t.Fatal(err)
			}
			wantReplay(t, servertest.Start(t, bin, args...), key, req, first, "a new process")

			var ids []string
			err = spannertest.Client(t, db).Single().Query(t.Context(), spanner.Statement{SQL: "SELECT id FROM charges"}).Do(func(row *spanner.Row) error {
				var id string
				ids = append(ids, id)
				return row.Columns(&ids[len(ids)-1])
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(ids) != 1 || ids[0] != first.GetId() {
				t.Errorf("charges in Spanner: %q; want the one charge %q", ids, first.GetId())
			}
		})
	}
}
