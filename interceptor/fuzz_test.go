package interceptor_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkey/idemkey/engine"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

// FuzzStoredOutcome: whatever bytes a store hands back as a recorded outcome
// (a corrupt or truncated row, a record of another version), the replay never
// panics and never runs the handler; it answers the recorded reply, or
// Internal.
func FuzzStoredOutcome(f *testing.F) {
	charge, _ := proto.Marshal(&paymentsv1.Charge{Id: "ch_1", Amount: 100, Currency: "EUR"})
	for _, out := range []*idemkeyv1.Outcome{
		{Result: &idemkeyv1.Outcome_Response{Response: charge}},
		{Result: &idemkeyv1.Outcome_Status{Status: &idemkeyv1.Status{Code: int32(codes.FailedPrecondition), Message: []byte("declined")}}},
		{Result: &idemkeyv1.Outcome_Status{Status: &idemkeyv1.Status{Code: int32(codes.OK)}}},
		{Result: &idemkeyv1.Outcome_Response{Response: charge}, Header: []*idemkeyv1.MetadataEntry{{Key: "x-id", Values: [][]byte{[]byte("1")}}}},
		{Result: &idemkeyv1.Outcome_Response{Response: charge}, Trailer: []*idemkeyv1.MetadataEntry{{Key: "Bad Key", Values: [][]byte{{0xff}}}}},
	} {
		raw, err := proto.Marshal(out)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(raw)
		f.Add(raw[:len(raw)/2])
	}
	f.Add([]byte{})
	f.Add([]byte{0xff, 0xff, 0xff})

	d := newDirect(f, engine.WithLogger(nil))
	d.svc.create = func(context.Context, *paymentsv1.CreateChargeRequest) (*paymentsv1.Charge, error) {
		panic("the handler ran for a recorded key")
	}
	fp, err := protokey.HashRequest(createCharge, request(1))
	if err != nil {
		f.Fatal(err)
	}
	n := 0
	f.Fuzz(func(t *testing.T, raw []byte) {
		n++
		key := idemkey.NewKey()
		scope := store.ScopeKey("", createCharge, key)
		res, err := d.store.Reserve(context.Background(), store.Reservation{Key: scope, Fingerprint: fp, Lease: time.Minute, Retention: time.Hour})
		if err != nil || res.State != store.Acquired {
			t.Fatalf("Reserve: %v, %v", res.State, err)
		}
		if err := d.store.Complete(context.Background(), scope, res.Token, raw); err != nil {
			t.Fatal(err)
		}
		resp, _, err := d.call(context.Background(), createCharge, request(1), idemkey.KeyMetadata, key)
		switch {
		case err == nil:
			if _, ok := resp.(*paymentsv1.Charge); !ok {
				t.Fatalf("replay answered %T, want a Charge", resp)
			}
		case status.Code(err) == codes.OK:
			t.Fatalf("replay answered an error with code OK: %v", err)
		}
		if n%1000 == 0 { // keep the memory store small over a long fuzz run
			d.clock.Advance(t, 2*time.Hour)
			_, _ = d.store.Sweep(context.Background(), 0)
		}
	})
}
