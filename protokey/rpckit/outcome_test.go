package rpckit

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
)

// TestResponseAlone: a record that holds a response alone is read without
// its Outcome, as the Outcome's unmarshalling reads it; any other record,
// one with metadata, a response repeated or cut short, is read by the
// Outcome's unmarshalling.
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
			rec, err := decode(c.raw, output)
			var out idemkeyv1.Outcome
			wantErr := proto.Unmarshal(c.raw, &out)
			if wantErr == nil && out.GetResult() == nil {
				wantErr = errors.New("neither a response nor an error")
			}
			if (err != nil) != (wantErr != nil) {
				t.Fatalf("decode: %v; the Outcome's: %v", err, wantErr)
			}
			want := output.New().Interface()
			if err == nil {
				if err := proto.Unmarshal(out.GetResponse(), want); err != nil {
					t.Fatal(err)
				}
			}
			if err == nil && !proto.Equal(rec.Response, want) {
				t.Fatalf("decode: %v; the Outcome's: %v", rec.Response, want)
			}
		})
	}
}
