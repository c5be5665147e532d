package interceptor

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/protokey"
)

// TestResponseAlone: a record that holds a response alone is read without
// its Outcome, as protokey.DecodeOutcome reads it; any other record, one
// with metadata, a response repeated or cut short, is read by
// protokey.DecodeOutcome.
func TestResponseAlone(t *testing.T) {
	charge, _ := proto.Marshal(&paymentsv1.Charge{Id: "ch_1", Amount: 100, Currency: "EUR"})
	alone, _ := proto.Marshal(&idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Response{Response: charge}})
	withHeader, _ := proto.Marshal(&idemkeyv1.Outcome{Result: &idemkeyv1.Outcome_Response{Response: charge},
		Header: []*idemkeyv1.MetadataEntry{{Key: "x-id", Values: [][]byte{[]byte("1")}}}})
	output := (&paymentsv1.Charge{}).ProtoReflect().Type()
	for _, c := range []struct {
		name  string
		raw   []byte
		alone bool
	}{
		{"alone", alone, true},
		{"with a header", withHeader, false},
		{"twice", append(append([]byte{}, alone...), alone...), false},
		{"cut short", alone[:len(alone)-1], false},
		{"another field", protowire.AppendVarint(protowire.AppendTag(nil, outcomeResponse, protowire.VarintType), 1), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if _, ok := responseAlone(c.raw); ok != c.alone {
				t.Fatalf("responseAlone: %v, want %v", ok, c.alone)
			}
			rec, err := decodeOutcome(c.raw, output)
			_, want, wantErr := protokey.DecodeOutcome(c.raw, output)
			if (err != nil) != (wantErr != nil) {
				t.Fatalf("decodeOutcome: %v; protokey.DecodeOutcome: %v", err, wantErr)
			}
			if err == nil && !proto.Equal(rec.resp.(proto.Message), want) {
				t.Fatalf("decodeOutcome: %v; protokey.DecodeOutcome: %v", rec.resp, want)
			}
		})
	}
}
