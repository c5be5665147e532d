package protokey

import (
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// RequestIDField is AIP-155's name for the field that carries the key.
const RequestIDField = "request_id"

// KeyField returns md's field that carries the idempotency key, or nil: the
// singular string field name, or without a name, a singular string
// request_id annotated (google.api.field_info).format = UUID4 (AIP-155).
func KeyField(md protoreflect.MessageDescriptor, name string) protoreflect.FieldDescriptor {
	if md == nil {
		return nil
	}
	fd := md.Fields().ByName(protoreflect.Name(name))
	if name == "" {
		fd = md.Fields().ByName(RequestIDField)
		if fd == nil || !isUUID4(fd) {
			return nil
		}
	}
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.Cardinality() == protoreflect.Repeated {
		return nil
	}
	return fd
}

func isUUID4(fd protoreflect.FieldDescriptor) bool {
	info, _ := proto.GetExtension(fd.Options(), annotations.E_FieldInfo).(*annotations.FieldInfo)
	return info.GetFormat() == annotations.FieldInfo_UUID4
}

// KeyFromField returns the key req carries in fd, a field KeyField found.
func KeyFromField(req proto.Message, fd protoreflect.FieldDescriptor) string {
	return req.ProtoReflect().Get(fd).String()
}
