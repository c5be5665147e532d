package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/idemkey/idemkey/internal/pgtest"
	"github.com/idemkey/idemkey/internal/servertest"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// With -outbox, a charge's message is written with the charge, in the
// call's transaction: one message a charge, announcing it, whose id is not
// the key; a replay writes none; a call that fails after the charge's write
// (-fail-after-write) rolls its message back with it. The relay is
// elsewhere (-relay=false), so the broker is never reached.
func TestOutboxMessageWithCharge(t *testing.T) {
	bin := servertest.Build(t)
	for _, atomic := range []bool{true} { // -outbox needs atomic mode (flags_test.go)
		t.Run(fmt.Sprint("atomic=", atomic), func(t *testing.T) {
			schema := pgtest.Schema(t)
			db := pgtest.Pool(t, schema)
			args := []string{"-database-url", pgtest.SchemaURL(schema), "-atomic=" + fmt.Sprint(atomic),
				"-outbox", "nats://127.0.0.1:1", "-relay=false"}
			if atomic {
				args = append(args, "-fail-after-write", "1")
			}
			s := servertest.Start(t, bin, args...)
			key := "outbox-key-" + schema
			req := &paymentsv1.CreateChargeRequest{CustomerId: "cus_outbox", Amount: 500, Currency: "EUR"}
			if atomic {
				_, _, err := create(s, key, req)
				if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "-fail-after-write") {
					t.Fatalf("first call: %v, want Unavailable from -fail-after-write", err)
				}
				if c, m := count(t, db, "charges"), count(t, db, "idempotency_keys_outbox"); c != 0 || m != 0 {
					t.Fatalf("after a call that failed after its write: %d charges, %d messages; want both rolled back", c, m)
				}
			}
			charge, _, err := create(s, key, req)
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := create(s, key, req); err != nil { // a replay
				t.Fatal(err)
			}
			if c := count(t, db, "charges"); c != 1 {
				t.Errorf("%d charges, want 1", c)
			}
			rows, _ := db.Query(context.Background(), `SELECT id, destination, body FROM idempotency_keys_outbox`)
			type message struct {
				ID, Destination string
				Body            []byte
			}
			ms, err := pgx.CollectRows(rows, pgx.RowToStructByPos[message])
			if err != nil {
				t.Fatal(err)
			}
			if len(ms) != 1 {
				t.Fatalf("%d messages, want 1", len(ms))
			}
			m := ms[0]
			if m.Destination != "payments.charge.created" {
				t.Errorf("the message goes to %q, want payments.charge.created", m.Destination)
			}
			want := fmt.Sprintf(`{"id":%q,"tenant":"acme","amount":500,"currency":"EUR"}`, charge.GetId())
			if !bytes.HasSuffix(m.Body, []byte(want)) || !bytes.Contains(m.Body, []byte("tenant")) {
				t.Errorf("the message's body is %q, want the header tenant and the payload %s", m.Body, want)
			}
			if m.ID == "" || strings.Contains(m.ID, key) {
				t.Errorf("the message's id is %q: want one derived from the key, not the key", m.ID)
			}
			if strings.Contains(s.Logs(), key) {
				t.Errorf("the server logged the key")
			}
		})
	}
}
