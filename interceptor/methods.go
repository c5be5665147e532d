package interceptor

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
)

// method is what the interceptors need to know about one RPC method, looked
// up once from the protobuf registry.
type method struct {
	name    string // "/package.Service/Method"
	covered bool
	atomic  bool                     // run in one transaction with its record: see WithAtomic
	output  protoreflect.MessageType // nil if the method is not in the registry
	// keyField is the request field that carries the key (AIP-155), if any.
	keyField protoreflect.FieldDescriptor
	op       *engine.Operation // the server's operation; nil if not covered, or on the client
}

// methods caches method lookups. gRPC calls interceptors only for registered
// methods, so the cache is bounded by the service's own API.
type methods struct {
	opts  *options
	eng   *engine.Engine // the server's; nil on the client
	cache sync.Map       // full method name -> *method
}

func (ms *methods) get(fullMethod string) *method {
	if m, ok := ms.cache.Load(fullMethod); ok {
		return m.(*method)
	}
	m, _ := ms.cache.LoadOrStore(fullMethod, ms.describe(fullMethod))
	return m.(*method)
}

// describe decides whether a method is covered: every method not marked
// NO_SIDE_EFFECTS or IDEMPOTENT in its proto, except those of gRPC's own
// services (package grpc.*: health, reflection and the like), unless an option
// says otherwise. A method whose descriptor or response type is missing from
// the protobuf registry is covered only when included by name.
func (ms *methods) describe(fullMethod string) *method {
	pm := protokey.DescribeMethod(fullMethod, nil, ms.opts.keyField)
	m := &method{name: fullMethod, covered: pm.Covered, output: pm.Output, keyField: pm.KeyField}
	if ms.opts.included[fullMethod] {
		m.covered = true
	}
	if ms.opts.excluded[fullMethod] {
		m.covered = false
	}
	m.atomic = ms.opts.atomicAll || ms.opts.atomic[fullMethod]
	if m.covered && ms.eng != nil {
		// The server checked at construction that the engine can serve it
		// (a store for atomic mode, a way to tell tenants apart), the only
		// ways this fails.
		attrs, status := protokey.RPCMetrics("grpc", fullMethod)
		m.op, _ = ms.eng.Operation(engine.OperationSpec{Name: fullMethod, Atomic: m.atomic,
			Metrics: engine.MetricsSpec{Attributes: attrs, Status: status}})
	}
	return m
}

// checkMethods returns an error naming each method that o lists by name
// (WithIncludedMethods, WithExcludedMethods, WithAtomicMethods) and that
// the protobuf registry does not know, or that WithAtomicMethods names but
// the options leave uncovered: a typo, or a bare "CreateCharge", would
// otherwise be ignored without a word.
func checkMethods(o *options) error {
	var problems []string
	for _, set := range []struct {
		option string
		names  map[string]bool
	}{{"WithIncludedMethods", o.included}, {"WithExcludedMethods", o.excluded}, {"WithAtomicMethods", o.atomic}} {
		for _, name := range slices.Sorted(maps.Keys(set.names)) {
			if protokey.Lookup(name) == nil {
				problems = append(problems, fmt.Sprintf("%s(%q): no such method in the protobuf registry; want \"/package.Service/Method\" of a generated service", set.option, name))
			}
		}
	}
	ms := &methods{opts: o}
	for _, name := range slices.Sorted(maps.Keys(o.atomic)) {
		if protokey.Lookup(name) != nil && !ms.describe(name).covered {
			problems = append(problems, fmt.Sprintf("WithAtomicMethods(%q): the method is not covered (its idempotency_level, or WithExcludedMethods), so it would never run in atomic mode", name))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("idemkey: %s", strings.Join(problems, "; "))
	}
	return nil
}
