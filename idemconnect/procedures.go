package idemconnect

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
)

// procedure is what the interceptors need to know about one procedure,
// decided on its first call.
type procedure struct {
	name    string // "/package.Service/Method"
	covered bool
	output  protoreflect.MessageType // nil if the procedure is not in the registry
	// keyField is the request field that carries the key (AIP-155), if any.
	keyField protoreflect.FieldDescriptor
	op       *engine.Operation // the server's; nil if not covered, or on the client
}

// procedures caches procedure lookups. Connect calls interceptors only for
// the procedures its handlers serve, and names them by the handler's
// procedure rather than the request's path, so the cache is bounded by the
// service's own API.
type procedures struct {
	cov       coverage
	atomicAll bool
	atomic    map[string]bool
	eng       *engine.Engine // the server's; nil on the client
	cache     sync.Map       // procedure -> *procedure
}

func (ps *procedures) get(spec connect.Spec) *procedure {
	if p, ok := ps.cache.Load(spec.Procedure); ok {
		return p.(*procedure)
	}
	p, _ := ps.cache.LoadOrStore(spec.Procedure, ps.describe(spec))
	return p.(*procedure)
}

// describe decides whether a procedure is covered, as the gRPC interceptor
// decides for a method: every procedure not marked NO_SIDE_EFFECTS or
// IDEMPOTENT (in its proto, or by connect.WithIdempotency), except those of
// gRPC's own services (package grpc.*), unless an option says otherwise. A
// procedure whose response type is missing from the protobuf registry is
// covered only when included by name.
func (ps *procedures) describe(spec connect.Spec) *procedure {
	desc, _ := spec.Schema.(protoreflect.MethodDescriptor)
	pm := protokey.DescribeMethod(spec.Procedure, desc, ps.cov.keyField)
	p := &procedure{name: spec.Procedure, covered: pm.Covered, output: pm.Output, keyField: pm.KeyField}
	if spec.IdempotencyLevel == connect.IdempotencyNoSideEffects || spec.IdempotencyLevel == connect.IdempotencyIdempotent {
		p.covered = false
	}
	if ps.cov.included[spec.Procedure] {
		p.covered = true
	}
	if ps.cov.excluded[spec.Procedure] {
		p.covered = false
	}
	if p.covered && ps.eng != nil {
		// NewServerInterceptor checked that the engine can serve it (a
		// store for atomic mode, a way to tell tenants apart), the only
		// ways this fails.
		attrs, status := protokey.RPCMetrics("connectrpc", spec.Procedure)
		p.op, _ = ps.eng.Operation(engine.OperationSpec{
			Name:    spec.Procedure,
			Atomic:  ps.atomicAll || ps.atomic[spec.Procedure],
			Metrics: engine.MetricsSpec{Attributes: attrs, Status: status},
		})
	}
	return p
}

// checkProcedures returns an error naming each procedure that an option
// names and the protobuf registry does not know, or that WithAtomicProcedures
// names but the options leave uncovered: a typo, or a bare "CreateCharge",
// would otherwise be ignored without a word.
func checkProcedures(cov coverage, atomic map[string]bool) error {
	var problems []string
	for _, set := range []struct {
		option string
		names  map[string]bool
	}{{"WithIncludedProcedures", cov.included}, {"WithExcludedProcedures", cov.excluded}, {"WithAtomicProcedures", atomic}} {
		for _, name := range slices.Sorted(maps.Keys(set.names)) {
			if protokey.Lookup(name) == nil {
				problems = append(problems, fmt.Sprintf("%s(%q): no such procedure in the protobuf registry; want \"/package.Service/Method\" of a generated service", set.option, name))
			}
		}
	}
	ps := &procedures{cov: cov}
	for _, name := range slices.Sorted(maps.Keys(atomic)) {
		if protokey.Lookup(name) != nil && !ps.describe(connect.Spec{Procedure: name}).covered {
			problems = append(problems, fmt.Sprintf("WithAtomicProcedures(%q): the procedure is not covered (its idempotency_level, or WithExcludedProcedures), so it would never run in atomic mode", name))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("idemkey: %s", strings.Join(problems, "; "))
	}
	return nil
}
