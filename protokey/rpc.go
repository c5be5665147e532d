package protokey

import (
	"errors"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
)

// Method is what the gRPC and Connect adapters know of one method, from its
// descriptor and the protobuf registry.
type Method struct {
	Name string // "/package.Service/Method"
	// Output is the response type, which a replay builds; nil if the
	// registry lacks it.
	Output protoreflect.MessageType
	// Covered is the default coverage: every method but those whose proto
	// declares idempotency_level NO_SIDE_EFFECTS or IDEMPOTENT, and those of
	// gRPC's own services (package grpc.*), provided it can be replayed
	// (Output is known).
	Covered bool
	// KeyField is the request field that carries the key (KeyField), if any.
	KeyField protoreflect.FieldDescriptor
}

// DescribeMethod describes the method fullMethod, whose descriptor is desc
// (nil: looked up in the registry). keyField is KeyField's name, or nil
// for a method whose requests carry no key of their own.
func DescribeMethod(fullMethod string, desc protoreflect.MethodDescriptor, keyField *string) Method {
	m := Method{Name: fullMethod}
	if desc == nil {
		desc = Lookup(fullMethod)
	}
	if desc == nil {
		return m
	}
	m.Output, _ = protoregistry.GlobalTypes.FindMessageByName(desc.Output().FullName())
	opts, _ := desc.Options().(*descriptorpb.MethodOptions)
	level := opts.GetIdempotencyLevel()
	m.Covered = m.Output != nil &&
		!strings.HasPrefix(fullMethod, "/grpc.") &&
		level != descriptorpb.MethodOptions_NO_SIDE_EFFECTS &&
		level != descriptorpb.MethodOptions_IDEMPOTENT
	if keyField != nil {
		m.KeyField = KeyField(desc.Input(), *keyField)
	}
	return m
}

// Lookup finds a method descriptor in the registry by its full name,
// "/package.Service/Method"; nil if there is none.
func Lookup(fullMethod string) protoreflect.MethodDescriptor {
	service, name, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if !ok {
		return nil
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		return nil
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil
	}
	return sd.Methods().ByName(protoreflect.Name(name))
}

// RPCMetrics labels a method's measurements with OpenTelemetry's RPC
// conventions, as otelgrpc labels its own, for an engine.MetricsSpec:
// attrs are rpc.system.name system ("grpc", "connectrpc"), rpc.service and
// rpc.method "package.Service/Method"; status is rpc.response.status_code,
// the code's canonical name ("OK", "INVALID_ARGUMENT"), a code past
// Unauthenticated counting as Unknown.
func RPCMetrics(system, fullMethod string) (attrs []attribute.KeyValue, status func(code int) attribute.KeyValue) {
	method := strings.TrimPrefix(fullMethod, "/")
	service, _, _ := strings.Cut(method, "/")
	return []attribute.KeyValue{
		attribute.String("rpc.system.name", system),
		attribute.String("rpc.service", service),
		attribute.String("rpc.method", method),
	}, statusCodeAttr
}

func statusCodeAttr(code int) attribute.KeyValue {
	if code < 0 || code > int(rpccode.Code_UNAUTHENTICATED) {
		code = int(rpccode.Code_UNKNOWN)
	}
	return attribute.String("rpc.response.status_code", rpccode.Code(code).String())
}

// EncodeResponse returns the record of a successful call: out, which holds
// its kept metadata (nil: none), with msg as its response. msg is marshalled
// straight into its field rather than into a buffer that is then copied:
// this is the hot path of every first call.
func EncodeResponse(msg proto.Message, out *idemkeyv1.Outcome) ([]byte, error) {
	size := proto.Size(msg)
	raw := make([]byte, 0, size+protowire.SizeVarint(uint64(size))+1+proto.Size(out))
	raw = protowire.AppendTag(raw, outcomeResponse, protowire.BytesType)
	raw = protowire.AppendVarint(raw, uint64(size))
	raw, err := proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(raw, msg)
	if err != nil {
		return nil, err
	}
	if out == nil {
		return raw, nil
	}
	return proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(raw, out)
}

// outcomeResponse is the field number of Outcome.response.
var outcomeResponse = (&idemkeyv1.Outcome{}).ProtoReflect().Descriptor().Fields().ByName("response").Number()

// DecodeOutcome reads a record that EncodeResponse, or an adapter's error
// encoding, wrote: resp is the response, a message of type output, when the
// call succeeded; otherwise out.GetStatus() is its error, whose code is not
// OK. An error means the record cannot be read; a corrupt record never
// panics.
func DecodeOutcome(raw []byte, output protoreflect.MessageType) (out *idemkeyv1.Outcome, resp proto.Message, err error) {
	out = &idemkeyv1.Outcome{}
	if err := proto.Unmarshal(raw, out); err != nil {
		return nil, nil, err
	}
	switch r := out.GetResult().(type) {
	case *idemkeyv1.Outcome_Response:
		resp = output.New().Interface()
		if err := proto.Unmarshal(r.Response, resp); err != nil {
			return nil, nil, err
		}
		return out, resp, nil
	case *idemkeyv1.Outcome_Status:
		if r.Status.GetCode() == 0 {
			return nil, nil, errors.New("recorded error has code OK")
		}
		return out, nil, nil
	}
	return nil, nil, errors.New("recorded outcome holds neither a response nor an error")
}
