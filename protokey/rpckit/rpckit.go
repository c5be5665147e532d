// Package rpckit is what idemkey's gRPC and Connect adapters (interceptor,
// idemconnect) share of the protobuf world, written once: which methods are
// covered, where a call's key comes from, the record's encoding, the
// replayed metadata and the statuses idemkey answers with, all as
// transport-neutral values. Each adapter keeps only its wire: grpc-go's or
// connect-go's types in and out.
//
// It is the adapters' kit, not an application's, and changes with the
// adapters in any release. It is published rather than internal because
// idemconnect is a module of its own, and may not import another module's
// internal packages (scripts/check-deps).
package rpckit

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/protokey"
)

// Coverage is what a server and a client both read: the methods forced in
// or out, the request field that carries the key, and (servers) the
// methods run in atomic mode and those with a retention of their own.
type Coverage struct {
	Included, Excluded map[string]bool
	KeyField           *string // WithKeyField, WithAnnotatedKeyField; nil: none
	AtomicAll          bool
	Atomic             map[string]bool
	Retention          map[string]time.Duration
	// LookupFirst is a client's smallest request asked about first
	// (interceptor.WithLookupFirst); a server refuses it (Check).
	LookupFirst int
}

// AddRetention sets d as the retention of each of names, in m (made if nil).
func AddRetention(m map[string]time.Duration, d time.Duration, names ...string) map[string]time.Duration {
	if m == nil {
		m = map[string]time.Duration{}
	}
	for _, name := range names {
		m[name] = d
	}
	return m
}

// Options are the settings of a server that both adapters have, each set by
// an option of the adapter's own.
type Options struct {
	Coverage
	Recorded uint32          // the codes whose outcome is recorded, a bit each (CodeSet)
	Replayed map[string]bool // lower-case metadata names replayed from the record
}

// Settings are a server's settings: those both adapters have, and the
// adapter's own fingerprint (F, a FingerprintFunc) and redaction (R, a
// RedactFunc), nil by default.
type Settings[F, R any] struct {
	Options
	Fingerprint F
	Redact      R
}

// NewSettings are the defaults of a server's settings.
func NewSettings[F, R any]() *Settings[F, R] {
	return &Settings[F, R]{Options: Options{Recorded: defaultRecorded}}
}

// defaultRecorded are the error codes whose outcome is final: a retry would
// get the same answer. Every other code releases the key.
const defaultRecorded uint32 = 1<<rpccode.Code_NOT_FOUND | 1<<rpccode.Code_ALREADY_EXISTS |
	1<<rpccode.Code_FAILED_PRECONDITION | 1<<rpccode.Code_OUT_OF_RANGE | 1<<rpccode.Code_UNIMPLEMENTED |
	1<<rpccode.Code_INTERNAL | 1<<rpccode.Code_UNKNOWN | 1<<rpccode.Code_DATA_LOSS

// CodeSet is the set of codes cs, a bit each (codes.Code, connect.Code).
func CodeSet[C ~uint32](cs ...C) uint32 {
	var set uint32
	for _, c := range cs {
		if c < 32 {
			set |= 1 << c
		}
	}
	return set
}

// Records reports whether an error of code is recorded; OK is not an error.
func (o *Options) Records(code int32) bool {
	return code > 0 && code < 32 && o.Recorded&(1<<code) != 0
}

// Replay adds names, in any case, to the metadata replayed from the record.
func (o *Options) Replay(names []string) {
	for _, n := range names {
		o.Replayed = Add(o.Replayed, strings.ToLower(n))
	}
}

// Add adds items to set, made if nil.
func Add(set map[string]bool, items ...string) map[string]bool {
	if set == nil {
		set = make(map[string]bool, len(items))
	}
	for _, it := range items {
		set[it] = true
	}
	return set
}

// Method is what an adapter knows of one method ("/package.Service/Method"),
// decided on its first call.
type Method struct {
	Name    string
	Covered bool
	// Output is the response type, which a replay builds; nil if the
	// registry lacks it.
	Output protoreflect.MessageType
	// KeyField is the request field that carries the key (AIP-155), if any.
	KeyField protoreflect.FieldDescriptor
	// Op is the server's operation; nil if not covered, or on a client.
	Op *engine.Operation
}

// Methods caches the methods of one server or client. The transports call
// interceptors only for the methods their services serve, so the cache is
// bounded by the service's own API.
type Methods struct {
	cov    Coverage
	eng    *engine.Engine // the server's; nil on a client
	system string         // rpc.system.name of the metrics
	cache  sync.Map       // name -> *Method
}

// NewMethods is the method table of a server on eng whose metrics name
// system ("grpc", "connectrpc"), or of a client (eng nil).
func NewMethods(cov Coverage, eng *engine.Engine, system string) *Methods {
	return &Methods{cov: cov, eng: eng, system: system}
}

// Get returns the method name, whose descriptor is desc (nil: looked up in
// the registry); idempotent is true when the transport declares it free of
// side effects or idempotent (connect.Spec.IdempotencyLevel).
func (ms *Methods) Get(name string, desc protoreflect.MethodDescriptor, idempotent bool) *Method {
	if m, ok := ms.cache.Load(name); ok {
		return m.(*Method)
	}
	m, _ := ms.cache.LoadOrStore(name, ms.describe(name, desc, idempotent))
	return m.(*Method)
}

// Find is Get for a name that a client sends (KeyService's operation): nil
// for a name the protobuf registry does not know, which is never cached, so
// that the cache stays bounded by the registry.
func (ms *Methods) Find(name string) *Method {
	if m, ok := ms.cache.Load(name); ok {
		return m.(*Method)
	}
	desc := lookup(name)
	if desc == nil {
		return nil
	}
	return ms.Get(name, desc, false)
}

// describe decides whether a method is covered: every method not marked
// NO_SIDE_EFFECTS or IDEMPOTENT in its proto (or by its transport), except
// those of gRPC's own services (package grpc.*: health, reflection and the
// like), unless an option says otherwise. A method whose descriptor or
// response type is missing from the protobuf registry is covered only when
// included by name.
func (ms *Methods) describe(name string, desc protoreflect.MethodDescriptor, idempotent bool) *Method {
	m := &Method{Name: name}
	if desc == nil {
		desc = lookup(name)
	}
	if desc != nil {
		m.Output, _ = protoregistry.GlobalTypes.FindMessageByName(desc.Output().FullName())
		opts, _ := desc.Options().(*descriptorpb.MethodOptions)
		level := opts.GetIdempotencyLevel()
		m.Covered = m.Output != nil && !idempotent &&
			!strings.HasPrefix(name, "/grpc.") &&
			level != descriptorpb.MethodOptions_NO_SIDE_EFFECTS &&
			level != descriptorpb.MethodOptions_IDEMPOTENT
		if ms.cov.KeyField != nil {
			m.KeyField = protokey.KeyField(desc.Input(), *ms.cov.KeyField)
		}
	}
	m.Covered = (m.Covered || ms.cov.Included[name]) && !ms.cov.Excluded[name]
	if m.Covered && ms.eng != nil {
		// The server checked at construction that the engine can serve it
		// (a store for atomic mode, a way to tell tenants apart), the only
		// ways this fails.
		attrs, status := rpcMetrics(ms.system, name)
		m.Op, _ = ms.eng.Operation(engine.OperationSpec{Name: name, Atomic: ms.cov.AtomicAll || ms.cov.Atomic[name],
			Metrics: engine.MetricsSpec{Attributes: attrs, Status: status}, Retention: ms.cov.Retention[name]})
	}
	return m
}

// lookup finds a method descriptor in the registry by its full name,
// "/package.Service/Method"; nil if there is none.
func lookup(fullMethod string) protoreflect.MethodDescriptor {
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

// Naming is how an adapter names its constructor, its options and a method,
// in the errors of Check.
type Naming struct {
	Constructor                string // "UnaryServerInterceptor"
	Included, Excluded, Atomic string // "WithIncludedMethods", ...
	Retention                  string // "WithMethodRetention"
	Method                     string // "method", "procedure"
}

// Check returns an error naming each method that cov lists by name and the
// protobuf registry does not know, or that cov runs in atomic mode but
// leaves uncovered: a typo, or a bare "CreateCharge", would otherwise be
// ignored without a word. With a server's engine, it also returns the
// engine's refusal of cov (no store.Atomic for atomic mode, no way to tell
// tenants apart); server is false on a client.
func Check(cov Coverage, n Naming, server bool, eng *engine.Engine) error {
	if server && eng == nil {
		return fmt.Errorf("idemkey: %s needs an engine: engine.New(store, engine.WithTenant(...))", n.Constructor)
	}
	if server && cov.LookupFirst > 0 {
		return fmt.Errorf("idemkey: %s: WithLookupFirst is the client interceptor's option; a server does not take it", n.Constructor)
	}
	var problems []string
	for _, set := range []struct {
		option string
		names  map[string]bool
	}{{n.Included, cov.Included}, {n.Excluded, cov.Excluded}, {n.Atomic, cov.Atomic}, {n.Retention, keys(cov.Retention)}} {
		for _, name := range slices.Sorted(maps.Keys(set.names)) {
			if lookup(name) == nil {
				problems = append(problems, fmt.Sprintf("%s(%q): no such %s in the protobuf registry; want \"/package.Service/Method\" of a generated service", set.option, name, n.Method))
			}
		}
	}
	ms := NewMethods(cov, nil, "")
	for _, name := range slices.Sorted(maps.Keys(cov.Atomic)) {
		if lookup(name) != nil && !ms.describe(name, nil, false).Covered {
			problems = append(problems, fmt.Sprintf("%s(%q): the %s is not covered (its idempotency_level, or %s), so it would never run in atomic mode", n.Atomic, name, n.Method, n.Excluded))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(cov.Retention)) {
		if lookup(name) != nil && !ms.describe(name, nil, false).Covered {
			problems = append(problems, fmt.Sprintf("%s(%q): the %s is not covered (its idempotency_level, or %s), so it keeps no keys", n.Retention, name, n.Method, n.Excluded))
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("idemkey: %s", strings.Join(problems, "; "))
	}
	if server {
		if _, err := eng.Operation(engine.OperationSpec{Atomic: cov.AtomicAll || len(cov.Atomic) > 0}); err != nil {
			return err
		}
		for _, name := range slices.Sorted(maps.Keys(cov.Retention)) {
			if _, err := eng.Operation(engine.OperationSpec{Name: name, Retention: cov.Retention[name]}); err != nil {
				return fmt.Errorf("%w (%s)", err, n.Retention)
			}
		}
	}
	return nil
}

// keys is the set of m's keys.
func keys[V any](m map[string]V) map[string]bool {
	set := make(map[string]bool, len(m))
	for k := range m {
		set[k] = true
	}
	return set
}
