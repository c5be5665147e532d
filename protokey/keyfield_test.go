package protokey_test

import (
	"testing"

	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/idemkey/idemkey/internal/protohash"
	"github.com/idemkey/idemkey/protokey"
)

// requests builds a message type Req with the given string fields, each
// annotated (google.api.field_info).format = UUID4 if uuid4 says so, and an
// int64 field "count".
func requests(t *testing.T, fields map[string]bool) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("Req"), Field: []*descriptorpb.FieldDescriptorProto{{
		Name: proto.String("count"), Number: proto.Int32(1), Type: descriptorpb.FieldDescriptorProto_TYPE_INT64.Enum(),
		Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String("count"),
	}}}
	n := int32(2)
	for name, uuid4 := range fields {
		opts := &descriptorpb.FieldOptions{}
		if uuid4 {
			proto.SetExtension(opts, annotations.E_FieldInfo, &annotations.FieldInfo{Format: annotations.FieldInfo_UUID4})
		}
		msg.Field = append(msg.Field, &descriptorpb.FieldDescriptorProto{
			Name: proto.String(name), Number: proto.Int32(n), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String(name), Options: opts,
		})
		n++
	}
	file, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("req.proto"), Package: proto.String("test"), Syntax: proto.String("proto3"),
		Dependency:  []string{"google/api/field_info.proto"},
		MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	if err != nil {
		t.Fatal(err)
	}
	return file.Messages().Get(0)
}

func TestKeyField(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fields map[string]bool
		option string
		want   string // the key field's name, "" for none
	}{
		{"request_id annotated UUID4 is found", map[string]bool{"request_id": true}, "", "request_id"},
		{"request_id without the annotation is not", map[string]bool{"request_id": false}, "", ""},
		{"another UUID4 field is not", map[string]bool{"customer_id": true}, "", ""},
		{"a field named by the option is", map[string]bool{"request_id": false}, "request_id", "request_id"},
		{"the option names its field, not request_id", map[string]bool{"request_id": true, "op_id": false}, "op_id", "op_id"},
		{"a field that is not a string is not", nil, "count", ""},
		{"a field that does not exist is not", nil, "request_id", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fd := protokey.KeyField(requests(t, tc.fields), tc.option)
			got := ""
			if fd != nil {
				got = string(fd.Name())
			}
			if got != tc.want {
				t.Fatalf("KeyField = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestFingerprintWithout: the key field is left out, and nothing else.
func TestFingerprintWithout(t *testing.T) {
	md := requests(t, map[string]bool{"request_id": true, "note": false})
	fd := protokey.KeyField(md, "")
	msg := func(count int64, id, note string) proto.Message {
		m := dynamicpb.NewMessage(md)
		m.Set(md.Fields().ByName("count"), protoreflect.ValueOfInt64(count))
		m.Set(md.Fields().ByName("request_id"), protoreflect.ValueOfString(id))
		m.Set(md.Fields().ByName("note"), protoreflect.ValueOfString(note))
		return m
	}
	fp := func(m proto.Message) [32]byte {
		return protohash.Hash("/test.S/M", m, fd)
	}
	if fp(msg(1, "a", "x")) != fp(msg(1, "b", "x")) {
		t.Fatal("the request_id changed the fingerprint")
	}
	if fp(msg(1, "a", "x")) == fp(msg(1, "a", "y")) || fp(msg(1, "a", "x")) == fp(msg(2, "a", "x")) {
		t.Fatal("a field the server reads did not change the fingerprint")
	}
	plain, _ := protokey.HashRequest("/test.S/M", msg(1, "", "x"))
	if fp(msg(1, "a", "x")) != plain {
		t.Fatal("a request without its key field fingerprints otherwise than Fingerprint's")
	}
}
