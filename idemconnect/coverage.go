package idemconnect

import (
	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/protokey/rpckit"
)

// procedure is what the interceptors know of the procedure of spec: a
// method whose descriptor is spec.Schema, which connect.WithIdempotency may
// declare free of side effects. Connect calls interceptors only for the
// procedures its handlers serve, and names them by the handler's procedure
// rather than the request's path, so the table is bounded by the service's
// own API.
func procedure(ms *rpckit.Methods, spec connect.Spec) *rpckit.Method {
	desc, _ := spec.Schema.(protoreflect.MethodDescriptor)
	return ms.Get(spec.Procedure, desc, spec.IdempotencyLevel == connect.IdempotencyNoSideEffects || spec.IdempotencyLevel == connect.IdempotencyIdempotent)
}

// WithIncludedProcedures covers the given procedures ("/package.Service/Method")
// whatever their idempotency level says.
func WithIncludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.Included = rpckit.Add(c.Included, procedures...) })
}

// WithExcludedProcedures leaves the given procedures uncovered: they pass
// through untouched. It wins over WithIncludedProcedures.
func WithExcludedProcedures(procedures ...string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.Excluded = rpckit.Add(c.Excluded, procedures...) })
}

// WithKeyField takes the idempotency key from the request field name too, as
// AIP-155 does with request_id, in every covered procedure whose request has
// a singular string field of that name. It works as the gRPC interceptor's
// WithKeyField: a request whose field and Idempotency-Key header carry
// different keys is refused (IDEMPOTENCY_KEY_INVALID), and the default
// fingerprint leaves the field out, so keys are shared with the gRPC
// interceptor only if both are given the same field. The client interceptor
// adds no key to a request that sets the field.
func WithKeyField(name string) ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.KeyField = &name })
}

// WithAnnotatedKeyField is WithKeyField for the field AIP-155 describes: a
// request_id annotated (google.api.field_info).format = UUID4 (AIP-202).
func WithAnnotatedKeyField() ProcedureOption {
	return procedureOption(func(c *rpckit.Coverage) { c.KeyField = new(string) })
}
