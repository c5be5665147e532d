package idemconnect

import (
	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/protokey/rpckit"
)

// procedure is what the interceptors know of spec's procedure. Connect names
// it by the handler's procedure, not the request's path, so the table is
// bounded by the service's own API.
func procedure(ms *rpckit.Methods, spec connect.Spec) *rpckit.Method {
	desc, _ := spec.Schema.(protoreflect.MethodDescriptor)
	return ms.Get(spec.Procedure, desc, spec.IdempotencyLevel == connect.IdempotencyNoSideEffects || spec.IdempotencyLevel == connect.IdempotencyIdempotent)
}

// WithIncludedProcedures covers the given procedures ("/package.Service/Method")
// whatever their idempotency level says.
func WithIncludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.Included = rpckit.Add(c.Included, procedures...) })
}

// WithExcludedProcedures leaves procedures uncovered, over the included.
func WithExcludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.Excluded = rpckit.Add(c.Excluded, procedures...) })
}

// WithKeyField is interceptor.WithKeyField: the key may come in the request's
// string field name too (AIP-155 request_id). Keys are shared with the gRPC
// interceptor only if both are given the same field.
func WithKeyField(name string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.KeyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for a request_id annotated
// (google.api.field_info).format = UUID4 (AIP-202).
func WithAnnotatedKeyField() ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.KeyField = new(string) })
}
