package protokey

import (
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// RequestIDField is the name AIP-155 gives the field that carries a
// request's idempotency key.
const RequestIDField = "request_id"

// KeyField returns the field of request messages md that carries the
// idempotency key (AIP-155), or nil if none does: with name set, the
// singular string field of that name; otherwise a singular string field
// named request_id that is annotated (google.api.field_info).format = UUID4,
// as AIP-155 asks (AIP-202). A field of another kind is never the key's.
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

// KeyFromField returns the key req carries in fd, "" if none. fd must be
// a field of req's message, as KeyField found it.
func KeyFromField(req proto.Message, fd protoreflect.FieldDescriptor) string {
	return req.ProtoReflect().Get(fd).String()
}
