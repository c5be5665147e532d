package protokey_test

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/protokey"
)

// FuzzFingerprint: any request fingerprints without a panic, the same on
// every call, for a copy, and for another encoding of it: its fields in
// another order (each number's values in theirs) with every tag, varint and
// length padded. Another method fingerprints differently. Without unknown
// fields, the fingerprint is that of deterministic marshalling, as in earlier
// releases.
func FuzzFingerprint(f *testing.F) {
	for _, req := range []*paymentsv1.CreateChargeRequest{
		{},
		request(1),
		{CustomerId: "cus_1", Amount: -5, Currency: "EUR", Description: "é\x00", MerchantReference: "order-1"},
	} {
		raw, err := proto.Marshal(req)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(createCharge, raw)
	}
	f.Add("", []byte{0x08, 0x96, 0x01})           // a field number the request does not have
	f.Add(createCharge, []byte{0xa0, 0x1f, 0x01}) // an unknown field, kept on unmarshal
	// Unknown fields 500 (a padded varint, then another) and 501, and field 2
	// sent twice.
	f.Add(createCharge, []byte{0x10, 0x01, 0xa0, 0x1f, 0x81, 0x80, 0x00, 0xaa, 0x1f, 0x01, 0x78, 0x10, 0x02, 0xa0, 0x1f, 0x05})
	// An unknown group, and field 1 as a fixed32, unknown.
	f.Add(createCharge, []byte{0xa3, 0x1f, 0x08, 0x01, 0xa4, 0x1f, 0x0d, 0x01, 0x02, 0x03, 0x04})
	f.Fuzz(func(t *testing.T, method string, raw []byte) {
		req := &paymentsv1.CreateChargeRequest{}
		if proto.Unmarshal(raw, req) != nil {
			return
		}
		fp, err := protokey.HashRequest(method, req)
		if err != nil {
			t.Fatalf("Fingerprint: %v", err)
		}
		again, err := protokey.HashRequest(method, proto.Clone(req).(*paymentsv1.CreateChargeRequest))
		if err != nil || again != fp {
			t.Fatalf("a copy fingerprints as %x (%v), the original as %x", again, err, fp)
		}
		if other, _ := protokey.HashRequest(method+"x", req); other == fp {
			t.Fatalf("methods %q and %q give the same fingerprint", method, method+"x")
		}
		alt := reencode(t, raw)
		altReq := &paymentsv1.CreateChargeRequest{}
		if err := proto.Unmarshal(alt, altReq); err != nil {
			t.Fatalf("%x, another encoding of %x, does not unmarshal: %v", alt, raw, err)
		}
		if altFP, _ := protokey.HashRequest(method, altReq); altFP != fp {
			t.Fatalf("%x fingerprints as %x, %x, another encoding of it, as %x", raw, fp, alt, altFP)
		}
		if len(req.ProtoReflect().GetUnknown()) == 0 {
			marshalled, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
			if err != nil {
				t.Fatal(err)
			}
			want := sha256.Sum256(slices.Concat(binary.BigEndian.AppendUint64(nil, uint64(len(method))), []byte(method), marshalled))
			if fp != want {
				t.Fatalf("%x fingerprints as %x, its deterministic marshalling as %x", raw, fp, want)
			}
		}
	})
}

// reencode is raw, which is a valid message, with its fields in descending
// order of number (each number's in their order) and every tag, varint and
// length padded by two bytes, up to ten.
func reencode(t *testing.T, raw []byte) []byte {
	type field struct {
		num protowire.Number
		b   []byte
	}
	pad := func(b []byte, v uint64) []byte {
		return append(b, padded(v, min(protowire.SizeVarint(v)+2, 10))...)
	}
	var fields []field
	for len(raw) > 0 {
		num, typ, n := protowire.ConsumeField(raw)
		if n < 0 {
			t.Fatalf("%x unmarshals but does not parse: %v", raw, protowire.ParseError(n))
		}
		_, _, tagLen := protowire.ConsumeTag(raw)
		b, value := pad(nil, protowire.EncodeTag(num, typ)), raw[tagLen:n]
		switch typ {
		case protowire.VarintType:
			v, _ := protowire.ConsumeVarint(value)
			b = pad(b, v)
		case protowire.BytesType:
			v, _ := protowire.ConsumeBytes(value)
			b = append(pad(b, uint64(len(v))), v...)
		default:
			b = append(b, value...)
		}
		fields = append(fields, field{num, b})
		raw = raw[n:]
	}
	slices.SortStableFunc(fields, func(x, y field) int { return cmp.Compare(y.num, x.num) })
	var out []byte
	for _, f := range fields {
		out = append(out, f.b...)
	}
	return out
}
