package protokey_test

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
	"github.com/idemkey/idemkey/protokey"
	"github.com/idemkey/idemkey/store"
)

// Two methods of the example PaymentService, whose requests the tests
// fingerprint.
const (
	createCharge = "/example.payments.v1.PaymentService/CreateCharge"
	getCharge    = "/example.payments.v1.PaymentService/GetCharge"
)

// request is a CreateChargeRequest of amount.
func request(amount int64) *paymentsv1.CreateChargeRequest {
	return &paymentsv1.CreateChargeRequest{CustomerId: "cus_1", Amount: amount, Currency: "EUR"}
}

// The test schema, in version 1:
//
//	enum Kind { KIND_UNSPECIFIED = 0; KIND_A = 1; KIND_B = 2; }
//	message Sub { string name = 1; int64 n = 2; }
//	message Req {
//	  string s = 1; int64 i = 2; repeated int32 r = 3; map<string, int64> m = 4;
//	  Sub sub = 6; sint32 z = 7; fixed64 f = 8; bool b = 9; Kind e = 10; double d = 11;
//	}
//
// Version 2 adds a field 5 to Req (of the kind a test chooses) and
// int32 extra = 3 to Sub.
const testPackage = "idemkey.fingerprinttest"

// schema returns Req of version 1, or of version 2 if field5 is not nil.
func schema(t testing.TB, field5 *descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	type fdp = descriptorpb.FieldDescriptorProto
	field := func(name string, num int32, typ descriptorpb.FieldDescriptorProto_Type) *fdp {
		return &fdp{Name: proto.String(name), Number: proto.Int32(num), Type: typ.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
	}
	repeated := func(f *fdp) *fdp { f.Label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum(); return f }
	ofType := func(f *fdp, name string) *fdp { f.TypeName = proto.String("." + testPackage + "." + name); return f }
	const (
		str     = descriptorpb.FieldDescriptorProto_TYPE_STRING
		int64T  = descriptorpb.FieldDescriptorProto_TYPE_INT64
		message = descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
	)
	sub := &descriptorpb.DescriptorProto{Name: proto.String("Sub"), Field: []*fdp{field("name", 1, str), field("n", 2, int64T)}}
	req := &descriptorpb.DescriptorProto{
		Name: proto.String("Req"),
		Field: []*fdp{
			field("s", 1, str),
			field("i", 2, int64T),
			repeated(field("r", 3, descriptorpb.FieldDescriptorProto_TYPE_INT32)),
			ofType(repeated(field("m", 4, message)), "Req.MEntry"),
			ofType(field("sub", 6, message), "Sub"),
			field("z", 7, descriptorpb.FieldDescriptorProto_TYPE_SINT32),
			field("f", 8, descriptorpb.FieldDescriptorProto_TYPE_FIXED64),
			field("b", 9, descriptorpb.FieldDescriptorProto_TYPE_BOOL),
			ofType(field("e", 10, descriptorpb.FieldDescriptorProto_TYPE_ENUM), "Kind"),
			field("d", 11, descriptorpb.FieldDescriptorProto_TYPE_DOUBLE),
		},
		NestedType: []*descriptorpb.DescriptorProto{{
			Name:    proto.String("MEntry"),
			Field:   []*fdp{field("key", 1, str), field("value", 2, int64T)},
			Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		}},
	}
	if field5 != nil {
		f := proto.Clone(field5).(*fdp)
		f.Number = proto.Int32(5)
		if f.Label == nil {
			f.Label = descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()
		}
		if f.GetType() == message {
			f.TypeName = proto.String("." + testPackage + ".Sub")
		}
		req.Field = append(req.Field, f)
		sub.Field = append(sub.Field, field("extra", 3, descriptorpb.FieldDescriptorProto_TYPE_INT32))
	}
	file := &descriptorpb.FileDescriptorProto{
		Name:    proto.String("idemkey/fingerprinttest.proto"),
		Package: proto.String(testPackage),
		Syntax:  proto.String("proto3"),
		EnumType: []*descriptorpb.EnumDescriptorProto{{
			Name: proto.String("Kind"),
			Value: []*descriptorpb.EnumValueDescriptorProto{
				{Name: proto.String("KIND_UNSPECIFIED"), Number: proto.Int32(0)},
				{Name: proto.String("KIND_A"), Number: proto.Int32(1)},
				{Name: proto.String("KIND_B"), Number: proto.Int32(2)},
			},
		}},
		MessageType: []*descriptorpb.DescriptorProto{sub, req},
	}
	fd, err := protodesc.NewFile(file, nil)
	if err != nil {
		t.Fatal(err)
	}
	return fd.Messages().ByName("Req")
}

// newField5 is field 5 of version 2, of each kind a new field may have.
var newField5 = map[string]*descriptorpb.FieldDescriptorProto{
	"int64":           {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_INT64.Enum()},
	"string":          {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum()},
	"bytes":           {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_BYTES.Enum()},
	"double":          {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_DOUBLE.Enum()},
	"repeated int32":  {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_INT32.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum()},
	"repeated string": {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum()},
	"message":         {Name: proto.String("added"), Type: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum()},
}

// Hand-written wire encodings, so that each test controls the bytes.

func cat(parts ...[]byte) []byte { return slices.Concat(parts...) }

func vint(num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
}

func i64(num protowire.Number, v uint64) []byte {
	return protowire.AppendFixed64(protowire.AppendTag(nil, num, protowire.Fixed64Type), v)
}

func i32(num protowire.Number, v uint32) []byte {
	return protowire.AppendFixed32(protowire.AppendTag(nil, num, protowire.Fixed32Type), v)
}

func bytesField(num protowire.Number, v []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), v)
}

func str(num protowire.Number, s string) []byte { return bytesField(num, []byte(s)) }

func entry(key string, value uint64) []byte { return bytesField(4, cat(str(1, key), vint(2, value))) }

// padded is v as a varint of n bytes, more than it needs.
func padded(v uint64, n int) []byte {
	b := make([]byte, n)
	for i := range n - 1 {
		b[i] = byte(v&0x7f) | 0x80
		v >>= 7
	}
	b[n-1] = byte(v)
	return b
}

// paddedVint is a varint field with its tag and value padded.
func paddedVint(num protowire.Number, v uint64) []byte {
	return cat(padded(protowire.EncodeTag(num, protowire.VarintType), 3), padded(v, protowire.SizeVarint(v)+3))
}

// paddedStr is a string field with its tag and length padded.
func paddedStr(num protowire.Number, s string) []byte {
	return cat(padded(protowire.EncodeTag(num, protowire.BytesType), 2), padded(uint64(len(s)), 4), []byte(s))
}

func packed(num protowire.Number, vs ...uint64) []byte {
	var b []byte
	for _, v := range vs {
		b = protowire.AppendVarint(b, v)
	}
	return bytesField(num, b)
}

// reqFields is a request of version 1, in order, with two unknown fields. An
// edit changes some of them; a nil field is left out.
func reqFields() [][]byte {
	return [][]byte{
		str(1, "abc"),
		vint(2, 300),
		packed(3, 1, 2, 300),
		entry("a", 1),
		entry("b", 2),
		bytesField(6, cat(str(1, "x"), vint(2, 5))),
		vint(7, protowire.EncodeZigZag(-3)),
		i64(8, 7),
		vint(9, 1),
		vint(10, 2),
		i64(11, math.Float64bits(1.5)),
		vint(20, 9),  // unknown
		str(21, "u"), // unknown
	}
}

// The index of each field in reqFields.
const (
	fieldS = iota
	fieldI
	fieldR
	fieldMapA
	fieldMapB
	fieldSub
	fieldZ
	fieldF
	fieldB
	fieldE
	fieldD
	unknown20
	unknown21
)

type edit func(f [][]byte) [][]byte

func set(i int, parts ...[]byte) edit {
	return func(f [][]byte) [][]byte { f[i] = cat(parts...); return f }
}

func encode(e edit) []byte {
	f := reqFields()
	if e != nil {
		f = e(f)
	}
	return cat(f...)
}

func shuffle(seed uint64) edit {
	return func(f [][]byte) [][]byte {
		rand.New(rand.NewPCG(seed, 0)).Shuffle(len(f), func(i, j int) { f[i], f[j] = f[j], f[i] })
		return f
	}
}

// schemas are the test schema of version 1, and of version 2 with field 5 a
// message: each test case holds for both.
func schemas(t *testing.T) map[string]protoreflect.MessageDescriptor {
	return map[string]protoreflect.MessageDescriptor{"v1": schema(t, nil), "v2": schema(t, newField5["message"])}
}

// fingerprintOf parses raw as a message of md and fingerprints it.
func fingerprintOf(t *testing.T, md protoreflect.MessageDescriptor, method string, raw []byte) store.Fingerprint {
	t.Helper()
	m := dynamicpb.NewMessage(md)
	if err := proto.Unmarshal(raw, m); err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	fp, err := protokey.HashRequest(method, m)
	if err != nil {
		t.Fatalf("Fingerprint: %v", err)
	}
	return fp
}

// TestFingerprintEncodingsOfOneRequest: the encodings of one request that a
// client may send give one fingerprint.
func TestFingerprintEncodingsOfOneRequest(t *testing.T) {
	zz := protowire.EncodeZigZag
	for _, tc := range []struct {
		name string
		a, b edit // nil is reqFields as they are
	}{
		{name: "fields reversed", b: func(f [][]byte) [][]byte { slices.Reverse(f); return f }},
		{name: "fields shuffled", b: shuffle(1)},
		{name: "fields shuffled again", b: shuffle(2)},
		{name: "repeated unpacked", b: set(fieldR, vint(3, 1), vint(3, 2), vint(3, 300))},
		{name: "repeated in packed runs", b: set(fieldR, packed(3, 1), vint(3, 2), packed(3, 300))},
		{name: "repeated split by other fields", b: func(f [][]byte) [][]byte {
			f[fieldR] = packed(3, 1)
			return append(f, packed(3, 2, 300))
		}},
		{name: "known varints padded", b: func(f [][]byte) [][]byte {
			f[fieldI], f[fieldZ], f[fieldB], f[fieldE] = paddedVint(2, 300), paddedVint(7, zz(-3)), paddedVint(9, 1), paddedVint(10, 2)
			return f
		}},
		{name: "packed varints padded", b: set(fieldR, padded(protowire.EncodeTag(3, protowire.BytesType), 2), padded(7, 3), padded(1, 2), padded(2, 2), padded(300, 3))},
		{name: "lengths padded", b: func(f [][]byte) [][]byte {
			inner := cat(paddedStr(1, "x"), paddedVint(2, 5))
			f[fieldS] = paddedStr(1, "abc")
			f[fieldSub] = cat(padded(protowire.EncodeTag(6, protowire.BytesType), 2), padded(uint64(len(inner)), 3), inner)
			return f
		}},
		{name: "unknown varint padded", b: set(unknown20, paddedVint(20, 9))},
		{name: "unknown length padded", b: set(unknown21, paddedStr(21, "u"))},
		{name: "unknown fields swapped", b: func(f [][]byte) [][]byte {
			f[unknown20], f[unknown21] = f[unknown21], f[unknown20]
			return f
		}},
		{name: "unknown fields first", b: func(f [][]byte) [][]byte {
			return append([][]byte{f[unknown21], f[unknown20]}, f[:unknown20]...)
		}},
		{name: "unknown fields in a sub-message",
			a: set(fieldSub, bytesField(6, cat(str(1, "x"), vint(2, 5), vint(9, 1), str(8, "q")))),
			b: set(fieldSub, bytesField(6, cat(paddedStr(8, "q"), vint(2, 5), paddedVint(9, 1), str(1, "x"))))},
		{name: "map entries swapped", b: func(f [][]byte) [][]byte {
			f[fieldMapA], f[fieldMapB] = f[fieldMapB], f[fieldMapA]
			return f
		}},
		{name: "map entry value first", b: set(fieldMapA, bytesField(4, cat(vint(2, 1), str(1, "a"))))},
		{name: "map key sent twice", b: func(f [][]byte) [][]byte { return append([][]byte{entry("a", 7)}, f...) }},
		{name: "scalars sent twice", b: func(f [][]byte) [][]byte { return append([][]byte{vint(2, 1), str(1, "zzz"), vint(9, 0)}, f...) }},
		{name: "message sent in parts", b: set(fieldSub, bytesField(6, str(1, "x")), bytesField(6, vint(2, 5)))},
		{name: "proto3 defaults sent",
			a: func(f [][]byte) [][]byte { f[fieldB], f[fieldSub] = nil, bytesField(6, str(1, "x")); return f },
			b: func(f [][]byte) [][]byte {
				f[fieldB], f[fieldSub] = vint(9, 0), bytesField(6, cat(str(1, "x"), vint(2, 0)))
				return f
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := encode(tc.a), encode(tc.b)
			for version, md := range schemas(t) {
				if fa, fb := fingerprintOf(t, md, createCharge, a), fingerprintOf(t, md, createCharge, b); fa != fb {
					t.Errorf("%s: %x fingerprints as %x, %x as %x", version, a, fa, b, fb)
				}
			}
		})
	}
}

// TestFingerprintDifferentRequests: a request that differs in a field the
// server reads, or in an unknown field's value, fingerprints differently.
func TestFingerprintDifferentRequests(t *testing.T) {
	zz := protowire.EncodeZigZag
	for _, tc := range []struct {
		name string
		a, b edit // nil is reqFields as they are
	}{
		{name: "string", b: set(fieldS, str(1, "abd"))},
		{name: "int64", b: set(fieldI, vint(2, 301))},
		{name: "repeated element", b: set(fieldR, packed(3, 1, 2, 301))},
		{name: "repeated order", b: set(fieldR, packed(3, 2, 1, 300))},
		{name: "repeated element added", b: set(fieldR, packed(3, 1, 2, 300, 0))},
		{name: "map value", b: set(fieldMapA, entry("a", 3))},
		{name: "map key", b: set(fieldMapA, entry("c", 1))},
		{name: "map entry left out", b: set(fieldMapA)},
		{name: "sub-message field", b: set(fieldSub, bytesField(6, cat(str(1, "y"), vint(2, 5))))},
		{name: "sint32", b: set(fieldZ, vint(7, zz(-4)))},
		{name: "fixed64", b: set(fieldF, i64(8, 8))},
		{name: "bool", b: set(fieldB)},
		{name: "enum", b: set(fieldE, vint(10, 1))},
		{name: "double", b: set(fieldD, i64(11, math.Float64bits(2.5)))},
		{name: "unknown varint", b: set(unknown20, vint(20, 10))},
		{name: "unknown string", b: set(unknown21, str(21, "v"))},
		{name: "unknown field number", b: set(unknown20, vint(22, 9))},
		{name: "unknown wire type", b: set(unknown20, i32(20, 9))},
		{name: "unknown field left out", b: set(unknown20)},
		{name: "unknown values of one number in another order",
			a: set(unknown20, vint(20, 9), vint(20, 10)),
			b: set(unknown20, vint(20, 10), vint(20, 9))},
		{name: "unknown field in a sub-message",
			a: set(fieldSub, bytesField(6, cat(str(1, "x"), vint(9, 1)))),
			b: set(fieldSub, bytesField(6, cat(str(1, "x"), vint(9, 2))))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := encode(tc.a), encode(tc.b)
			for version, md := range schemas(t) {
				if fingerprintOf(t, md, createCharge, a) == fingerprintOf(t, md, createCharge, b) {
					t.Errorf("%s: %x and %x fingerprint the same", version, a, b)
				}
			}
		})
	}
	t.Run("method", func(t *testing.T) {
		md := schema(t, nil)
		if fingerprintOf(t, md, createCharge, encode(nil)) == fingerprintOf(t, md, getCharge, encode(nil)) {
			t.Error("one request fingerprints the same for two methods")
		}
	})
}

// TestFingerprintAcrossSchemaVersions: a server of version 1, which reads
// field 5 and Sub's field 3 as unknown, fingerprints a request as a server of
// version 2 does, for whatever kind the new field is, when a protobuf encoder
// wrote the request.
func TestFingerprintAcrossSchemaVersions(t *testing.T) {
	v1 := schema(t, nil)
	for kind, field5 := range newField5 {
		t.Run(kind, func(t *testing.T) {
			v2 := schema(t, field5)
			fd := v2.Fields().ByNumber(5)
			newRequest := func(n int64) []byte {
				m := dynamicpb.NewMessage(v2)
				if err := proto.Unmarshal(encode(nil), m); err != nil {
					t.Fatal(err)
				}
				sub := m.Mutable(v2.Fields().ByNumber(6)).Message()
				sub.Set(sub.Descriptor().Fields().ByNumber(3), protoreflect.ValueOfInt32(int32(-n)))
				set := func(v protoreflect.Value) { m.Set(fd, v) }
				switch kind {
				case "int64":
					set(protoreflect.ValueOfInt64(n))
				case "string":
					set(protoreflect.ValueOfString(fmt.Sprint("new-", n)))
				case "bytes":
					set(protoreflect.ValueOfBytes([]byte{byte(n), 0, 0xff}))
				case "double":
					set(protoreflect.ValueOfFloat64(float64(n) / 3))
				case "repeated int32":
					l := m.Mutable(fd).List()
					for _, v := range []int32{7, -1, int32(n), 300} {
						l.Append(protoreflect.ValueOfInt32(v))
					}
				case "repeated string":
					l := m.Mutable(fd).List()
					for _, v := range []string{"z", fmt.Sprint(n), "a"} {
						l.Append(protoreflect.ValueOfString(v))
					}
				case "message":
					v := m.NewField(fd)
					s := v.Message()
					s.Set(s.Descriptor().Fields().ByNumber(1), protoreflect.ValueOfString("new"))
					s.Set(s.Descriptor().Fields().ByNumber(2), protoreflect.ValueOfInt64(n))
					s.Set(s.Descriptor().Fields().ByNumber(3), protoreflect.ValueOfInt32(-1))
					set(v)
				default:
					t.Fatalf("no value for a field of kind %s", kind)
				}
				// Deterministic, so that fields go in number order, as
				// generated code writes them: dynamicpb's plain Marshal
				// writes them in any order, which varies from build to build.
				raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
				if err != nil {
					t.Fatal(err)
				}
				return raw
			}
			raw := newRequest(-42)
			if old, current := fingerprintOf(t, v1, createCharge, raw), fingerprintOf(t, v2, createCharge, raw); old != current {
				t.Errorf("%x fingerprints as %x with field 5 unknown, as %x with it known", raw, old, current)
			}
			if other := newRequest(42); fingerprintOf(t, v1, createCharge, raw) == fingerprintOf(t, v1, createCharge, other) {
				t.Errorf("with field 5 unknown, %x and %x fingerprint the same", raw, other)
			}
		})
	}
}

// TestFingerprintIsDeterministicMarshallingWithoutUnknownFields: for a
// message without unknown fields, extensions or oneofs, the fingerprint is
// that of earlier releases, the SHA-256 of the method's length, the method
// and the request marshalled deterministically, so their records still match.
func TestFingerprintIsDeterministicMarshallingWithoutUnknownFields(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, newMessage := range []func() proto.Message{
		func() proto.Message { return new(paymentsv1.CreateChargeRequest) },
		func() proto.Message { return new(paymentsv1.Charge) },
		func() proto.Message { return new(paymentsv1.ListChargesResponse) },
		func() proto.Message { return dynamicpb.NewMessage(schema(t, nil)) },
		func() proto.Message { return dynamicpb.NewMessage(schema(t, newField5["repeated int32"])) },
		func() proto.Message { return dynamicpb.NewMessage(schema(t, newField5["message"])) },
	} {
		for range 200 {
			m := newMessage()
			fill(r, m.ProtoReflect(), 0)
			raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			want := sha256.Sum256(slices.Concat(binary.BigEndian.AppendUint64(nil, uint64(len(createCharge))), []byte(createCharge), raw))
			if got, err := protokey.HashRequest(createCharge, m); err != nil || got != want {
				t.Fatalf("%v fingerprints as %x (%v), want %x", m, got, err, want)
			}
		}
	}
}

// fill sets a random value in about two thirds of m's fields, but none in a
// oneof, which deterministic marshalling writes last.
func fill(r *rand.Rand, m protoreflect.Message, depth int) {
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if od := fd.ContainingOneof(); r.IntN(3) == 0 || od != nil && !od.IsSynthetic() {
			continue
		}
		switch {
		case fd.IsMap():
			mv := m.Mutable(fd).Map()
			for range r.IntN(5) {
				mv.Set(randomValue(r, fd.MapKey(), nil, depth).MapKey(), randomValue(r, fd.MapValue(), mv.NewValue, depth))
			}
		case fd.IsList():
			l := m.Mutable(fd).List()
			for range r.IntN(5) {
				l.Append(randomValue(r, fd, l.NewElement, depth))
			}
		default:
			m.Set(fd, randomValue(r, fd, func() protoreflect.Value { return m.NewField(fd) }, depth))
		}
	}
}

// randomValue is a random value of fd's kind; newMessage makes an empty one
// of a message kind.
func randomValue(r *rand.Rand, fd protoreflect.FieldDescriptor, newMessage func() protoreflect.Value, depth int) protoreflect.Value {
	n := func() uint64 { // small, medium or any
		return []uint64{r.Uint64N(128), r.Uint64N(1 << 20), r.Uint64()}[r.IntN(3)]
	}
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(r.IntN(2) == 0)
	case protoreflect.EnumKind:
		values := fd.Enum().Values()
		return protoreflect.ValueOfEnum(values.Get(r.IntN(values.Len())).Number())
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(n()))
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(int64(n()))
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(n()))
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(n())
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(float32(r.NormFloat64()))
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(r.NormFloat64() * 1e6)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(string([]rune("aé\x00€𝄞z")[:r.IntN(7)]))
	case protoreflect.BytesKind:
		b := make([]byte, r.IntN(300))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return protoreflect.ValueOfBytes(b)
	}
	v := newMessage()
	if depth < 3 {
		fill(r, v.Message(), depth+1)
	}
	return v
}

// TestFingerprintExtensions: a set extension counts in its place by number,
// the same known as unknown; and a group too.
func TestFingerprintExtensions(t *testing.T) {
	type fdp = descriptorpb.FieldDescriptorProto
	optional := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()
	file, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:    proto.String("idemkey/fingerprinttest2.proto"),
		Package: proto.String(testPackage + "2"),
		Syntax:  proto.String("proto2"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("Ext"),
			Field: []*fdp{
				{Name: proto.String("a"), Number: proto.Int32(1), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum()},
				{Name: proto.String("g"), Number: proto.Int32(2), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_GROUP.Enum(), TypeName: proto.String(".idemkey.fingerprinttest2.Ext.G")},
				{Name: proto.String("c"), Number: proto.Int32(200), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_INT64.Enum()},
			},
			NestedType: []*descriptorpb.DescriptorProto{{
				Name:  proto.String("G"),
				Field: []*fdp{{Name: proto.String("x"), Number: proto.Int32(1), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_INT32.Enum()}},
			}},
			ExtensionRange: []*descriptorpb.DescriptorProto_ExtensionRange{{Start: proto.Int32(100), End: proto.Int32(200)}},
		}},
		Extension: []*fdp{
			{Name: proto.String("x150"), Number: proto.Int32(150), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_INT64.Enum(), Extendee: proto.String(".idemkey.fingerprinttest2.Ext")},
			{Name: proto.String("x120"), Number: proto.Int32(120), Label: optional, Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Extendee: proto.String(".idemkey.fingerprinttest2.Ext")},
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	md := file.Messages().ByName("Ext")
	types := new(protoregistry.Types)
	for i := range file.Extensions().Len() {
		if err := types.RegisterExtension(dynamicpb.NewExtensionType(file.Extensions().Get(i))); err != nil {
			t.Fatal(err)
		}
	}
	group := cat(protowire.AppendTag(nil, 2, protowire.StartGroupType), vint(1, 3), protowire.AppendTag(nil, 2, protowire.EndGroupType))
	fingerprint := func(raw []byte, resolver protoregistry.ExtensionTypeResolver) store.Fingerprint {
		m := dynamicpb.NewMessage(md)
		if err := (proto.UnmarshalOptions{Resolver: resolver}).Unmarshal(raw, m); err != nil {
			t.Fatal(err)
		}
		fp, _ := protokey.HashRequest(createCharge, m)
		return fp
	}
	canonical := cat(str(1, "a"), group, str(120, "x"), vint(150, 7), vint(200, 9))
	known := fingerprint(canonical, types)
	for _, raw := range [][]byte{canonical, cat(vint(200, 9), paddedVint(150, 7), str(1, "a"), group, paddedStr(120, "x"))} {
		if fp := fingerprint(raw, types); fp != known {
			t.Errorf("with the extensions known, %x fingerprints as %x, %x as %x", canonical, known, raw, fp)
		}
		if fp := fingerprint(raw, new(protoregistry.Types)); fp != known {
			t.Errorf("%x fingerprints as %x with the extensions known, as %x with them unknown", raw, known, fp)
		}
	}
	if fp := fingerprint(cat(str(1, "a"), group, str(120, "x"), vint(150, 8), vint(200, 9)), types); fp == known {
		t.Error("another value of an extension fingerprints the same")
	}
	if fp := fingerprint(cat(str(1, "a"), group[:len(group)-1], vint(1, 4), group[len(group)-1:], str(120, "x"), vint(150, 7), vint(200, 9)), types); fp == known {
		t.Error("another value in a group fingerprints the same")
	}
}

// TestFingerprintNilRequest: a nil request fingerprints as an empty one.
func TestFingerprintNilRequest(t *testing.T) {
	empty, err := protokey.HashRequest(createCharge, new(paymentsv1.CreateChargeRequest))
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range []proto.Message{(*paymentsv1.CreateChargeRequest)(nil), nil} {
		if fp, err := protokey.HashRequest(createCharge, req); err != nil || fp != empty {
			t.Errorf("%#v fingerprints as %x (%v), an empty request as %x", req, fp, err, empty)
		}
	}
}

// BenchmarkFingerprint fingerprints a CreateChargeRequest, and with
// fp=marshal hashes it marshalled deterministically, as releases before the
// canonical fingerprint did.
func BenchmarkFingerprint(b *testing.B) {
	req := &paymentsv1.CreateChargeRequest{
		CustomerId:        "cus_NffrFeUfNV2Hib",
		Amount:            1999,
		Currency:          "EUR",
		Description:       "Order 1042: 2 T-shirts, size M",
		MerchantReference: "order-1042",
	}
	b.Run("fp=canonical", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := protokey.HashRequest(createCharge, req); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("fp=marshal", func(b *testing.B) {
		b.ReportAllocs()
		var buf []byte
		for b.Loop() {
			var err error
			buf = binary.BigEndian.AppendUint64(buf[:0], uint64(len(createCharge)))
			buf, err = proto.MarshalOptions{Deterministic: true}.MarshalAppend(append(buf, createCharge...), req)
			if err != nil {
				b.Fatal(err)
			}
			_ = sha256.Sum256(buf)
		}
	})
	b.Run("fp=canonical/unknown-fields", func(b *testing.B) {
		req := proto.Clone(req)
		req.ProtoReflect().SetUnknown(cat(paddedVint(21, 300), str(20, "u")))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := protokey.HashRequest(createCharge, req); err != nil {
				b.Fatal(err)
			}
		}
	})
}
